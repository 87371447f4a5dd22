"""The emulated GPUs behave like the published ones (DESIGN.md, calibration targets)."""

from __future__ import annotations

import itertools
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.gpu.base import GPUError, OperatorWork
from shared.gpu.emulated import EmulatedGPU, GPUProfile, available_profiles, load_profile, operator_cost
from shared.gpu.workload import ComposedWork, attention_work, experts_touched, ffn_work, lm_head_work
from shared.model.config import ModelArgs

PROFILES = ["a100", "a800", "b200", "h100", "h200"]
# Qwen3-8B dimensions.
QWEN3_8B = ModelArgs(arch="qwen3", vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8,
                     head_dim=128, intermediate_size=12288, qk_norm=True)
QWEN3_30B_A3B = ModelArgs(arch="qwen3_moe", vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                          head_dim=128, intermediate_size=6144, n_experts=128, n_experts_per_tok=8,
                          moe_intermediate_size=768, sparse_layers=tuple(range(48)))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def decode_attention(batch: int, context: int = 2048) -> ComposedWork:
    return attention_work(QWEN3_8B, batch, [context] * batch)


def test_profiles_load_and_carry_sources() -> None:
    assert available_profiles() == PROFILES
    for key in PROFILES:
        p = load_profile(key)
        assert p.key == key and p.sources and p.modelling_choices
        assert p.clocks_mhz[0] == p.min_mhz and p.clocks_mhz[-1] == p.max_mhz
        assert all(b - a == 15 for a, b in itertools.pairwise(p.clocks_mhz))
    a800 = load_profile("a800")
    assert (a800.min_mhz, a800.max_mhz, len(a800.clocks_mhz), a800.max_power_w) == (210, 1410, 81, 400)
    # context-resident idle at 1410 MHz 58-63 W (VoltanaLLM 57.65, splitwise-sim 63, DGX A100 59-62);
    # a released context saves 26-50 W (Model Parking Tax)
    assert 58 <= a800.context_idle_power_at(1410) <= 63
    assert 26 <= a800.context_idle_power_at(1410) - a800.idle_power_w <= 50
    for key in ("h100", "h200"):
        assert (load_profile(key).max_mhz, load_profile(key).max_power_w) == (1980, 700)
    with pytest.raises(GPUError, match="unknown GPU profile"):
        load_profile("v100")


@pytest.mark.parametrize("key", PROFILES)
@settings(max_examples=25, deadline=None)
@given(flops=st.floats(0, 1e14), bytes_moved=st.floats(0, 1e11), n_parts=st.integers(1, 3))
def test_time_non_increasing_power_non_decreasing_in_clock(key: str, flops: float, bytes_moved: float,
                                                           n_parts: int) -> None:
    p = load_profile(key)
    work = ComposedWork(flops, bytes_moved, parts=tuple(
        OperatorWork(flops * (i + 1) / n_parts, bytes_moved / (i + 1)) for i in range(n_parts)))
    costs = [operator_cost(p, work, f) for f in p.clocks_mhz]
    for lo, hi in itertools.pairwise(costs):
        assert hi.time_s <= lo.time_s * (1 + 1e-12)
        assert hi.power_w >= lo.power_w * (1 - 1e-12)
    assert costs[-1].power_w <= p.max_power_w + 1e-9
    assert costs[0].power_w >= p.warm_parked_power_w - 1e-9  # never below idle at the lowest clock


@pytest.mark.parametrize("key", PROFILES)
def test_energy_per_token_is_u_shaped_for_memory_bound_decode(key: str) -> None:
    p = load_profile(key)
    work = decode_attention(64)
    energy = [operator_cost(p, work, f).energy_j for f in p.clocks_mhz]
    best = min(energy)
    assert energy[0] > 1.2 * best and energy[-1] > 1.05 * best
    assert p.min_mhz < p.clocks_mhz[energy.index(best)] < p.max_mhz


def latency_sensitivity(profile: GPUProfile, work: OperatorWork, lo_mhz: float, hi_mhz: float) -> float:
    """d ln t / d ln f as the log-log slope of the modelled time between two clocks."""
    t_lo = operator_cost(profile, work, lo_mhz).time_s
    t_hi = operator_cost(profile, work, hi_mhz).time_s
    return math.log(t_lo / t_hi) / math.log(hi_mhz / lo_mhz)


@pytest.mark.parametrize("key", PROFILES)
def test_latency_sensitivity_targets(key: str) -> None:
    """AFlex Fig. 3: decode attention at batch 1 about 0.07; decode FFN at least 0.46 (met at large batch).
    Measured between the clock nearest f_max/2 and f_max."""
    p = load_profile(key)
    mid = min(p.clocks_mhz, key=lambda c: abs(c - p.max_mhz / 2))
    assert latency_sensitivity(p, decode_attention(1), mid, p.max_mhz) < 0.15
    assert latency_sensitivity(p, ffn_work(QWEN3_8B, 256), mid, p.max_mhz) >= 0.46
    assert latency_sensitivity(p, ffn_work(QWEN3_8B, 8192), mid, p.max_mhz) > 0.9  # prefill: compute-bound
    # Decode attention grows more sensitive with batch (short contexts, where the projections matter).
    sens = [latency_sensitivity(p, attention_work(QWEN3_8B, b, [256] * b), mid, p.max_mhz) for b in (1, 16, 256)]
    assert sens == sorted(sens)


def test_h200_decode_power_in_published_band() -> None:
    """H200 decode draws 137-300 W (arXiv 2605.11999): a decode layer (attention + FFN) at max clock."""
    p = load_profile("h200")
    for batch in (1, 8, 32):
        parts = (decode_attention(batch), ffn_work(QWEN3_8B, batch))
        costs = [operator_cost(p, w, p.max_mhz) for w in parts]
        mean_power = sum(c.energy_j for c in costs) / sum(c.time_s for c in costs)
        assert 137 <= mean_power <= 300


@pytest.mark.parametrize("key", ["a800", "h100"])
def test_energy_is_the_integral_of_power(key: str) -> None:
    clock = FakeClock()
    gpu = EmulatedGPU(key, clock=clock)
    p = gpu.profile
    start = gpu.total_energy_j()
    assert start == 0.0 and gpu.power_w() == gpu.idle_power_w
    landings = [(clock.now, p.default_mhz)]  # (time a clock takes effect, clock), the test's own record

    def idle_j(t0: float, t1: float) -> float:
        """Idle energy over [t0, t1] from the recorded switches (a switch inside splits the stretch)."""
        edges = [t0] + [t for t, _ in landings if t0 < t < t1] + [t1]
        return sum((b - a) * p.context_idle_power_at([c for t, c in landings if t <= a][-1])
                   for a, b in itertools.pairwise(edges))

    expected, last = 0.0, gpu.total_energy_j()
    works = [decode_attention(16), ffn_work(QWEN3_8B, 16), attention_work(QWEN3_8B, 512, [512]),
             lm_head_work(QWEN3_8B, 16)]
    for i, work in enumerate(works * 3):
        gap = 0.002 * (i % 3)
        expected += idle_j(clock.now, clock.now + gap)
        clock.now += gap
        if i % 4 == 1:
            result = gpu.set_sm_clock_mhz(gpu.min_sm_clock_mhz + 300 * i)
            if result.applied:
                landings = [x for x in landings if x[0] <= clock.now] + [
                    (clock.now + p.clock_switch_delay_s, result.target_mhz)]
        measured = 1e-6
        clock.now += measured
        t = gpu.run(work, measured)
        clock.now += max(0.0, t - measured)  # the caller waits for the modelled operator
        clock.now -= 1e-9  # sample power strictly inside the busy interval
        expected += gpu.power_w() * t
        assert gpu.power_w() > gpu.idle_power_w
        clock.now += 1e-9
        energy = gpu.total_energy_j()
        assert energy >= last
        last = energy
    assert gpu.total_energy_j() == pytest.approx(expected, rel=1e-9)
    expected += idle_j(clock.now, clock.now + 1.0)
    clock.now += 1.0
    assert gpu.total_energy_j() == pytest.approx(expected, rel=1e-9)
    assert gpu.power_w() == gpu.idle_power_w


def test_idle_power_with_and_without_context() -> None:
    clock = FakeClock()
    bare = EmulatedGPU("a800", clock=clock, context_resident=False)
    loaded = EmulatedGPU("a800", clock=clock)
    p = loaded.profile
    clock.now += 10
    assert bare.total_energy_j() == pytest.approx(10 * p.idle_power_w)
    assert loaded.total_energy_j() == pytest.approx(10 * p.context_idle_power_at(1410))


def test_cold_parking_draws_bare_idle_and_a_rejoin_costs_what_the_simulator_charges() -> None:
    """`release_context`: bare idle from then on; `create_context`: `cold_rejoin_s` of the weights at
    context-idle power (the simulator's fleet charges a rejoining GPU so), then context idle again."""
    clock = FakeClock()
    gpu = EmulatedGPU("a800", clock=clock)
    p = gpu.profile
    clock.now += 10
    gpu.release_context()
    clock.now += 20
    assert gpu.total_energy_j() == pytest.approx(10 * p.context_idle_power_at(1410) + 20 * p.idle_power_w)
    assert gpu.power_w() == p.idle_power_w
    weights = 8e9
    rejoin_s = gpu.create_context(weights)
    assert rejoin_s == pytest.approx(p.cold_rejoin_s(weights)) and gpu.create_context(weights) == 0.0  # once
    clock.now += rejoin_s + 5
    assert gpu.total_energy_j() == pytest.approx(10 * p.context_idle_power_at(1410) + 20 * p.idle_power_w
                                                 + rejoin_s * p.context_idle_power_w
                                                 + 5 * p.context_idle_power_at(1410))
    paced = EmulatedGPU("a800", clock=clock, pace=True, sleep=clock.sleep)
    paced.release_context()
    assert paced.create_context(weights) == pytest.approx(clock.slept[-1])  # the host waits the modelled load


@pytest.mark.parametrize("key", PROFILES)
def test_context_idle_follows_the_clock(key: str) -> None:
    """Idle with a context falls with the locked clock (floor + leakage·V + clock tree·f·V²), stays above
    bare idle, and equals the profile's context idle at f_max; the clock share is a parameter."""
    p = load_profile(key)
    idle = [p.context_idle_power_at(f) for f in p.clocks_mhz]
    assert all(b >= a for a, b in itertools.pairwise(idle))
    assert idle[-1] == pytest.approx(p.context_idle_power_w)
    assert p.idle_power_w < p.warm_parked_power_w == idle[0] < idle[-1]
    flat = p.with_idle_clock_share(0.0)
    steep = p.with_idle_clock_share(p.idle_clock_share + 0.04)
    assert flat.warm_parked_power_w > p.warm_parked_power_w > steep.warm_parked_power_w
    assert flat.context_idle_power_at(p.max_mhz) == pytest.approx(steep.context_idle_power_at(p.max_mhz))
    with pytest.raises(GPUError, match="idle clock share"):
        p.with_idle_clock_share(0.95)
    with pytest.raises(GPUError, match="below bare idle"):
        p.with_idle_clock_share(0.75)
    assert p.cold_rejoin_s(p.host_to_device_bytes_s) == pytest.approx(1.0 + p.context_create_s)


def test_idle_energy_follows_a_clock_switch() -> None:
    """An idle GPU draws the idle power of the clock in effect: the old one until the switch lands."""
    clock = FakeClock()
    gpu = EmulatedGPU("a800", clock=clock)
    p = gpu.profile
    gpu.set_sm_clock_mhz(p.min_mhz)
    clock.now += 1.0
    delay = p.clock_switch_delay_s
    expected = delay * p.context_idle_power_at(p.max_mhz) + (1.0 - delay) * p.context_idle_power_at(p.min_mhz)
    assert gpu.total_energy_j() == pytest.approx(expected, rel=1e-9)
    assert gpu.power_w() == pytest.approx(p.warm_parked_power_w)


def test_clock_snaps_clamps_and_switches_after_the_delay() -> None:
    clock = FakeClock()
    gpu = EmulatedGPU("a800", clock=clock)
    p = gpu.profile
    assert gpu.sm_clock_mhz() == p.default_mhz == 1410
    result = gpu.set_sm_clock_mhz(1000)
    assert result.applied and (result.requested_mhz, result.target_mhz) == (1000, 1005)
    assert gpu.sm_clock_mhz() == 1410  # not yet: the switch takes clock_switch_delay
    clock.now += p.clock_switch_delay_s / 2
    t_before = gpu.run(ffn_work(QWEN3_8B, 4096), 0.0)
    assert t_before == pytest.approx(gpu.cost(ffn_work(QWEN3_8B, 4096), 1410).time_s)
    clock.now += p.clock_switch_delay_s
    assert gpu.sm_clock_mhz() == 1005
    assert not gpu.set_sm_clock_mhz(1005).applied
    assert gpu.set_sm_clock_mhz(10_000).target_mhz == 1410
    assert gpu.set_sm_clock_mhz(-5).target_mhz == 210
    gpu.reset_sm_clock()
    clock.now += 1
    assert gpu.sm_clock_mhz() == p.default_mhz


@settings(max_examples=50, deadline=None)
@given(clock_mhz=st.integers(-1000, 5000))
def test_snap_is_supported_and_nearest(clock_mhz: int) -> None:
    gpu = EmulatedGPU("h100", clock=FakeClock())
    target = gpu.set_sm_clock_mhz(clock_mhz).target_mhz
    clocks = gpu.supported_sm_clocks_mhz()
    assert target in clocks
    assert abs(target - clock_mhz) == min(abs(c - clock_mhz) for c in clocks)


def test_pacing_sleeps_the_difference() -> None:
    clock = FakeClock()
    gpu = EmulatedGPU("a800", pace=True, clock=clock, sleep=clock.sleep)
    gpu.set_sm_clock_mhz(210)
    clock.now += 1
    work = ffn_work(QWEN3_8B, 2048)
    t = gpu.run(work, 1e-4)
    assert clock.slept == [pytest.approx(t - 1e-4)]
    gpu.run(work, 10.0)  # the host was slower than the model: no sleep
    assert len(clock.slept) == 1
    unpaced = EmulatedGPU("a800", clock=clock, sleep=clock.sleep)
    unpaced.run(work, 0.0)
    assert len(clock.slept) == 1


def test_pacing_really_sleeps() -> None:
    gpu = EmulatedGPU("a800", pace=True)
    gpu.set_sm_clock_mhz(210)
    time.sleep(gpu.profile.clock_switch_delay_s + 0.005)
    work = OperatorWork(flops=gpu.profile.peak_flops * 0.75 * (210 / 1410) * 0.05, bytes_moved=0)  # 50 ms at 210
    start = time.monotonic()
    t = gpu.run(work, 0.0)
    assert t == pytest.approx(0.05, rel=0.01)
    assert time.monotonic() - start >= 0.045


def test_workload_shapes() -> None:
    decode = decode_attention(4)
    assert decode.kind == "attention.decode" and [p.kind for p in decode.parts][1] == "attention.decode.core"
    assert decode.flops == pytest.approx(sum(p.flops for p in decode.parts))
    prefill = attention_work(QWEN3_8B, 512, [512])
    assert prefill.kind == "attention.prefill"
    # KV bytes grow with context; projection work does not.
    assert decode_attention(4, 4096).bytes_moved > decode_attention(4, 1024).bytes_moved
    assert ffn_work(QWEN3_8B, 1).bytes_moved >= 3 * 4096 * 12288 * 2
    assert ffn_work(QWEN3_8B, 4, phase="decode").kind == "ffn.decode"
    # MoE: only the touched experts' weights are read.
    assert experts_touched(QWEN3_30B_A3B, 1) == 8 and experts_touched(QWEN3_30B_A3B, 1000) == 128
    one, many = ffn_work(QWEN3_30B_A3B, 1), ffn_work(QWEN3_30B_A3B, 1000)
    expert_bytes = 2048 * 768 * 3 * 2
    assert 8 * expert_bytes <= one.bytes_moved < 9 * expert_bytes + 1e6
    assert many.bytes_moved >= 128 * expert_bytes
    assert math.isclose(many.flops / one.flops, 1000, rel_tol=1e-6)
    dense_layer = ffn_work(ModelArgs(**{**QWEN3_30B_A3B.__dict__, "sparse_layers": (1,)}), 1, layer=0)
    assert dense_layer.parts[0].kind == "ffn.swiglu"
    head = lm_head_work(QWEN3_8B, 2)
    assert head.flops == 2 * 2 * 4096 * 151936

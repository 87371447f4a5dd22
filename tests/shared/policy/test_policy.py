"""The pure policy on constructed cases."""

from __future__ import annotations

import pytest

from loadgen.sim.models import attention_weight_bytes, ffn_weight_bytes, get_model, kv_bytes_per_token
from shared.gpu.emulated import load_profile
from shared.perf import Predictor, cached_predictor
from shared.policy import (
    BatchingRule,
    BatchStats,
    ClockRule,
    ClusterSpec,
    PoolShape,
    SloMargin,
    WindowLoad,
    megascale_depth,
    overlap_floor,
    prefill_budget,
    provision,
    ttft_budget,
)
from shared.policy import choose_operating_point as choose


@pytest.fixture(scope="module")
def pred() -> Predictor:
    return cached_predictor(load_profile("a800"), get_model("qwen3-32b"))


def test_memory_bound_decode_attention_gets_a_lower_clock_than_ffn(pred: Predictor) -> None:
    shape = PoolShape(split=True, attention=4, ffn=2)
    b = 256
    op = choose(pred, shape, BatchStats("decode", b, b * 1500, b * 1500, b), 0.1, ClockRule())
    assert op.feasible
    assert op.clock_attention < op.clock_ffn


def test_depth_one_at_low_load(pred: Predictor) -> None:
    op = choose(pred, PoolShape(split=True, attention=1, ffn=1), BatchStats("decode", 4, 4000, 4000, 4), 0.1,
                        ClockRule())
    assert op.depth == 1


def test_max_clock_rule_and_one_clock_rule(pred: Predictor) -> None:
    shape = PoolShape(split=True, attention=2, ffn=2)
    s = BatchStats("decode", 64, 64 * 1000, 64 * 1000, 64)
    top = float(pred.clocks[-1])
    op = choose(pred, shape, s, 0.1, ClockRule(max_clock=True))
    assert (op.clock_attention, op.clock_ffn) == (top, top)
    op = choose(pred, shape, s, 0.1, ClockRule(per_operator=False))
    assert op.clock_attention == op.clock_ffn


def test_tighter_budget_never_lowers_the_clock(pred: Predictor) -> None:
    shape = PoolShape(split=False, replicas=8, tp=2)
    s = BatchStats("prefill", 8192, 8192, 8 * 1024 * 1024 / 2, 8)
    loose = choose(pred, shape, s, 1.0, ClockRule())
    tight = choose(pred, shape, s, 0.12, ClockRule())
    assert tight.clock_attention >= loose.clock_attention


def test_overlap_floor() -> None:
    assert overlap_floor(0.0, 1.0) == 2.0
    assert megascale_depth(0.1, 1.0) == 3  # tc < tf/2
    assert megascale_depth(0.8, 1.0) == 4


def test_provisioning_follows_load(pred: Predictor) -> None:
    args = get_model("qwen3-32b")
    spec = ClusterSpec(16, 80e9, attention_weight_bytes(args), ffn_weight_bytes(args), kv_bytes_per_token(args),
                       400e9, 0.34, 0.1, pred.profile.idle_power_w)  # parked cold
    low = provision(pred, WindowLoad(0.5, 1000, 200), spec, ClockRule())
    high = provision(pred, WindowLoad(12.0, 1000, 200), spec, ClockRule())
    assert low.feasible and high.feasible
    assert high.gpus > low.gpus
    assert low.prefill is not None and low.decode is not None


def test_batching_rules() -> None:
    assert prefill_budget(BatchingRule(adaptive=False, chunk_tokens=2048), 10_000, 5) == 2048
    assert prefill_budget(BatchingRule(), 10_000, 0) == 10_000
    # with decode in the batch, the chunk shrinks until the iteration fits the TPOT budget
    got = prefill_budget(BatchingRule(), 10_000, 5, lambda n: n / 50_000, 0.1)
    assert 4900 <= got <= 5000
    # a prompt already past its TTFT SLO: at least the fixed chunk, per group, however tight the TPOT budget
    tight = prefill_budget(BatchingRule(chunk_tokens=2048), 10_000, 5, lambda n: n / 5_000, 0.1, units=2)
    assert tight < 1000
    assert prefill_budget(BatchingRule(chunk_tokens=2048), 10_000, 5, lambda n: n / 5_000, 0.1, units=2,
                          overdue=True) == 4096
    assert prefill_budget(BatchingRule(chunk_tokens=2048), 3_000, 5, lambda n: n / 5_000, 0.1, units=2,
                          overdue=True) == 3_000  # never more than is queued
    assert prefill_budget(BatchingRule(), 10_000, 5, lambda n: n / 50_000, 0.1, overdue=True) == got  # already more
    assert ttft_budget(0.0, [0.4, 0.4], [1000, 3000], 1000) == pytest.approx(0.4 / 3)


def test_margin_adapts() -> None:
    m = SloMargin(margin=0.1)
    assert m.update(450.0, 400.0, 0.2) > 0.1
    before = m.margin
    assert m.update(100.0, 400.0, 0.0) < before


def test_one_long_prompt_is_bounded_by_its_group_and_tp_shortens_it(pred: Predictor) -> None:
    from shared.policy.pool_sizing import long_prompt_time

    p = 5000.0
    spread = BatchStats("prefill", p, p, p * p / 2, 1)  # no seq_*: the work would spread over all groups
    alone = BatchStats("prefill", p, p, p * p / 2, 1, p, p, p * p / 2)
    shape = PoolShape(split=True, attention=4, ffn=8)
    top = ClockRule(max_clock=True, depths=(1,))
    assert choose(pred, shape, alone, 0.0, top).time_s > 1.5 * choose(pred, shape, spread, 0.0,
                                                                                        top).time_s
    times = [long_prompt_time(pred, PoolShape(split=True, attention=4, ffn=8, attention_tp=tp), p) for tp in (1, 2, 4)]
    assert times[0] > times[1] > times[2]
    colo = [long_prompt_time(pred, PoolShape(split=False, replicas=16 // tp, tp=tp), p) for tp in (2, 4, 8)]
    assert colo[0] > colo[1] > colo[2]


def test_provisioning_uses_attention_tp_for_long_prompts(pred: Predictor) -> None:
    args = get_model("qwen3-32b")
    spec = ClusterSpec(16, 80e9, attention_weight_bytes(args), ffn_weight_bytes(args), kv_bytes_per_token(args),
                       400e9, 0.34, 0.1, pred.profile.idle_power_w)  # parked cold
    short = provision(pred, WindowLoad(2.0, 1000, 100, 1500), spec, ClockRule())
    long = provision(pred, WindowLoad(2.0, 2000, 30, 5000), spec, ClockRule())
    assert short.prefill is not None and long.prefill is not None
    assert long.prefill.attention_tp > 1
    assert long.prefill.attention_tp >= short.prefill.attention_tp


def test_fixed_chunks_scale_with_groups_and_cap_one_sequence() -> None:
    from shared.policy import seq_chunk_cap

    fixed = BatchingRule(adaptive=False, chunk_tokens=2048)
    assert prefill_budget(fixed, 100_000, 0, units=4) == 4 * 2048
    assert seq_chunk_cap(fixed, 8192) == 2048
    assert seq_chunk_cap(BatchingRule(), 8192) == 8192


def test_srpt_order_serves_short_prompts_first_and_ages_long_ones() -> None:
    from shared.policy import prefill_order

    srpt = BatchingRule(order="srpt", aging_s=10.0)
    # arrivals at t=0, 1, 2 with 5000, 300, 1200 tokens left: shortest first at t=2
    assert prefill_order(srpt, 2.0, [0.0, 1.0, 2.0], [5000, 300, 1200]) == [1, 2, 0]
    # after aging_s of waiting the long prompt ranks with the shortest (and ahead of later arrivals)
    assert prefill_order(srpt, 10.5, [0.0, 10.0, 10.2], [5000, 300, 1200])[0] == 0
    # FCFS keeps the queue order
    assert prefill_order(BatchingRule(), 2.0, [0.0, 1.0, 2.0], [5000, 300, 1200]) == [0, 1, 2]


@pytest.mark.parametrize("order", ["fcfs", "srpt"])
def test_priority_ranks_first_and_a_waiting_request_ages_one_level_per_step(order: str) -> None:
    """Checked against the rule written out, over every arrival/priority pattern of four requests."""
    import itertools
    import math

    from shared.policy import prefill_order

    rule = BatchingRule(order=order, aging_s=30.0, priority_aging_s=10.0)
    remaining = [900.0, 40.0, 300.0, 40.0]
    now = 25.0
    for arrivals in itertools.product([0.0, 14.0, 24.0], repeat=4):
        for prio in itertools.product([0, 1, 3], repeat=4):
            got = prefill_order(rule, now, list(arrivals), remaining, list(prio))
            base = prefill_order(rule, now, list(arrivals), remaining)
            level = [max(min(prio), p - math.floor((now - a) / 10.0)) for p, a in zip(prio, arrivals, strict=True)]
            assert got == sorted(base, key=lambda i: level[i]), (arrivals, prio)
    # a priority-3 request that waited 30 s ranks with fresh priority-0 ones (and, FCFS, before them)
    assert prefill_order(BatchingRule(), 30.0, [0.0, 29.0], [10, 10], [3, 0]) == [0, 1]
    assert prefill_order(BatchingRule(), 29.0, [0.0, 28.0], [10, 10], [3, 0]) == [1, 0]
    assert prefill_order(BatchingRule(), 29.0, [0.0, 28.0], [10, 10], [0, 0]) == [0, 1]


def test_prefill_only_iteration_is_capped_by_time_when_asked() -> None:
    rule = BatchingRule(prefill_iter_frac=0.25)
    assert prefill_budget(rule, 10_000, 0) == 10_000  # no predictor: everything queued
    got = prefill_budget(rule, 10_000, 0, lambda n: n / 40_000, 0.1, prefill_iter_s=0.1)
    assert 3900 <= got <= 4000


def test_marginal_objective_scores_energy_above_the_idle_floor(pred: Predictor) -> None:
    shape = PoolShape(split=False, replicas=4, tp=4)
    s = BatchStats("decode", 64, 64 * 1000, 64 * 1000, 64)
    total = choose(pred, shape, s, 0.1, ClockRule(per_operator=False))
    marginal = choose(pred, shape, s, 0.1, ClockRule(per_operator=False, objective="marginal"))
    assert marginal.feasible and total.feasible
    # idle power is free under "marginal", so it never runs faster than "total" does
    assert marginal.clock_attention <= total.clock_attention
    with pytest.raises(ValueError):
        choose(pred, shape, s, 0.1, ClockRule(objective="bogus"))


def test_marginal_decode_scores_decode_only_and_provisioning_ignores_it(pred: Predictor) -> None:
    shape = PoolShape(split=True, attention=1, ffn=1)
    dec = BatchStats("decode", 64, 64 * 1500, 64 * 1500, 64)
    md = ClockRule(objective="marginal-decode")
    assert choose(pred, shape, dec, 0.1, md).clock_ffn <= choose(pred, shape, dec, 0.1,
                                                                                    ClockRule()).clock_ffn
    pre = BatchStats("prefill", 2048, 2048, 2048 * 1024, 2)
    assert choose(pred, shape, pre, 0.2, md) == choose(pred, shape, pre, 0.2, ClockRule())
    args = get_model("qwen3-32b")
    spec = ClusterSpec(16, 80e9, attention_weight_bytes(args), ffn_weight_bytes(args), kv_bytes_per_token(args),
                       400e9, 0.34, 0.1, pred.profile.idle_power_w)  # parked cold
    load = WindowLoad(2.0, 1000, 200, 2500)
    assert provision(pred, load, spec, md) == provision(pred, load, spec, ClockRule())


def test_idle_aware_prefill_prices_the_wait_for_the_next_prompt(pred: Predictor) -> None:
    """A prefill iteration that empties the queue is scored by its energy plus the pool's idle power at the
    same clocks until the next prompt (exp(-rate·t)/rate); without a rate it is the total objective."""
    import numpy as np

    from shared.policy.operating_point import idle_floor_w

    shape = PoolShape(split=True, attention=2, ffn=4, attention_tp=2)
    pre = BatchStats("prefill", 1500, 1500, 1500 * 750, 1, 1500, 1500, 1500 * 750)
    idle_aware, total = ClockRule(objective="idle-aware"), ClockRule()
    assert choose(pred, shape, pre, 0.3, idle_aware) == choose(pred, shape, pre, 0.3, total)
    for rate_hz in (0.5, 2.0, 8.0):
        op = choose(pred, shape, pre, 0.3, idle_aware, next_prompt_rate_hz=rate_hz)
        # brute force over the clock table at the chosen depth: the least energy + idle wait that meets the budget
        t, e = [], []
        for fa in range(len(pred.clocks)):
            for ff in range(len(pred.clocks)):
                pinned = ClockRule(fixed_mhz=((pred.clocks[fa], pred.clocks[ff]),) * 2, depths=(op.depth,))
                p = choose(pred, shape, pre, 1e9, pinned)
                t.append(p.time_s)
                e.append(p.energy_j)
        t_a, e_a = np.array(t).reshape(len(pred.clocks), -1), np.array(e).reshape(len(pred.clocks), -1)
        score = e_a + idle_floor_w(pred, shape) * np.exp(-rate_hz * t_a) / rate_hz
        score[t_a > 0.3] = np.inf
        ia, iff = np.unravel_index(int(np.argmin(score)), score.shape)
        assert (op.clock_attention, op.clock_ffn) == (pred.clocks[ia], pred.clocks[iff]), rate_hz
    # a rarer next prompt means a longer wait at the chosen clocks' idle power: never faster clocks
    slow = choose(pred, shape, pre, 0.3, idle_aware, next_prompt_rate_hz=0.5)
    fast = choose(pred, shape, pre, 0.3, idle_aware, next_prompt_rate_hz=50.0)
    assert slow.clock_attention + slow.clock_ffn <= fast.clock_attention + fast.clock_ffn
    dec = BatchStats("decode", 64, 64 * 1500, 64 * 1500, 64)
    assert choose(pred, shape, dec, 0.1, idle_aware, next_prompt_rate_hz=1.0) == choose(
        pred, shape, dec, 0.1, ClockRule(objective="marginal"))

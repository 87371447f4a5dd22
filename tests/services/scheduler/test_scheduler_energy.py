"""Energy accounting, scheduler telemetry and frequency commands of the scheduler.

Pure tests of the clock planner (window_clocks.py) and of energy sharing come first; then the scheduler
on a real nats-server with fake workers (tests/test_scheduler.py's) that report a known
`energy_j` in every `MicrobatchDone` and register supported clocks.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import orjson
import pytest
from nats.aio.msg import Msg

from services.scheduler.passes import Pass, share_energy
from services.scheduler.state import RequestState
from services.scheduler.window_clocks import (
    PhaseSignal,
    SloRule,
    parse_fixed_clocks,
    percentile,
    plan_clocks,
    slo_direction,
    step,
)
from shared import subjects
from shared.gpu.snap import snap_clock
from shared.messages import (
    FrequencyCommand,
    MicrobatchDescriptor,
    MicrobatchDone,
    OutputDelta,
    Register,
    RegisterReply,
    SamplingSpec,
    SchedulerTelemetry,
    SeqResult,
    decode,
    encode,
)
from tests.services.scheduler.test_scheduler import FakeAttention, Mesh, collect, heartbeat, mesh, wait_for

A100 = list(range(210, 1411, 15))  # 210..1410 MHz in 15 MHz steps
COARSE = list(range(600, 1401, 100))  # 9 clocks: a few windows from max to min

# -- clock planner (pure) -------------------------------------------------------------------------


def test_parse_fixed_clocks() -> None:
    assert parse_fixed_clocks("") == {}
    fixed = parse_fixed_clocks("attention.decode=900, ffn.decode=1200,ffn=1000")
    assert fixed == {("attention", "decode"): 900, ("ffn", "decode"): 1200, ("ffn", "prefill"): 1000}
    for bad in ("gpu.decode=900", "attention.mixed=900", "attention.decode", "ffn=fast", "ffn=-5"):
        with pytest.raises(ValueError):
            parse_fixed_clocks(bad)


def test_snap_and_step_stay_in_the_table() -> None:
    assert [snap_clock(A100, f, "down") for f in (1000, 900, 100, 5000)] == [990, 900, 210, 1410]
    assert [snap_clock(A100, f, "up") for f in (1000, 900, 100, 5000)] == [1005, 900, 210, 1410]
    assert step(A100, 1410, -2) == 1380 and step(A100, 1410, 3) == 1410 and step(A100, 225, -5) == 210
    assert step(COARSE, 950, 1) == 1000  # an off-table clock snaps down first
    with pytest.raises(ValueError):
        snap_clock([], 1000, "down")


def test_slo_direction() -> None:
    rule = SloRule(low=0.7, high=0.9)
    assert slo_direction(PhaseSignal(50, 100), rule) == -1
    assert slo_direction(PhaseSignal(80, 100), rule) == 0
    assert slo_direction(PhaseSignal(95, 100), rule) == 1
    assert slo_direction(PhaseSignal(10, 100, misses=1), rule) == 1  # any miss: up
    assert slo_direction(PhaseSignal(None, 100), rule) == 0  # nothing observed: hold
    assert slo_direction(PhaseSignal(None, 100, misses=2), rule) == 1


def test_plan_policies() -> None:
    assert plan_clocks("max", "attention", A100)[0] == {"prefill": 1410, "decode": 1410}
    fixed = parse_fixed_clocks("attention.decode=900,ffn.decode=1200,ffn.prefill=1000")
    assert plan_clocks("fixed", "attention", A100, fixed=fixed)[0] == {"prefill": 1410, "decode": 900}
    assert plan_clocks("fixed", "ffn", A100, fixed=fixed)[0] == {"prefill": 990, "decode": 1200}
    assert plan_clocks("fixed", "ffn", COARSE, fixed=fixed)[0] == {"prefill": 1000, "decode": 1200}


def test_plan_slo_walks_down_then_up_within_the_table() -> None:
    rule = SloRule(down_steps=2, up_steps=4)
    clocks, _ = plan_clocks("slo", "attention", COARSE, previous=None, rule=rule)
    assert clocks == {"prefill": 1400, "decode": 1400}  # starts at max
    fast = {"prefill": PhaseSignal(20, 400), "decode": PhaseSignal(10, 120)}
    seen = []
    for _ in range(6):
        clocks, reason = plan_clocks("slo", "attention", COARSE, previous=clocks, signals=fast, rule=rule)
        seen.append(clocks["decode"])
    assert seen == [1200, 1000, 800, 600, 600, 600] and "down" in reason
    slow = {"prefill": PhaseSignal(300, 400), "decode": PhaseSignal(118, 120)}  # prefill holds, decode up
    clocks, reason = plan_clocks("slo", "attention", COARSE, previous=clocks, signals=slow, rule=rule)
    assert clocks == {"prefill": 600, "decode": 1000} and "up" in reason and "hold" in reason
    clocks, _ = plan_clocks("slo", "attention", COARSE, previous=clocks, signals=slow, rule=rule)
    assert clocks["decode"] == 1400
    clocks, _ = plan_clocks("slo", "attention", COARSE, previous=clocks, signals=slow, rule=rule)
    assert clocks["decode"] == 1400  # never above the table
    clocks, _ = plan_clocks("slo", "attention", COARSE, previous={"prefill": 9999, "decode": 1}, rule=rule)
    assert clocks == {"prefill": 1400, "decode": 600}  # no signal: hold, snapped into the table


def test_percentile_is_numpy_linear() -> None:
    assert percentile([], 90) is None
    assert percentile([5.0], 90) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], 90) == pytest.approx(9.1)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0


def test_share_energy_by_tokens() -> None:
    def state(rid: str, n: int) -> RequestState:
        return RequestState(rid, list(range(1, n + 1)), SamplingSpec(), 0.0)

    a, b, c = state("a", 3), state("b", 9), state("c", 4)
    group = [Pass.of(a, 3), Pass.of(b, 9)]
    share_energy(group, 1.2, set())
    assert a.energy_j == pytest.approx(0.3) and b.energy_j == pytest.approx(0.9)
    assert a.energy_j + b.energy_j == 1.2  # the last share is the remainder: exact
    share_energy([Pass.of(a, 3), Pass.of(c, 4)], 2.0, {"c"})  # c was refused: fed nothing
    assert a.energy_j == pytest.approx(2.3) and c.energy_j is None


# -- fake workers with energy and clocks ----------------------------------------------------------


def energy_of(desc: MicrobatchDescriptor) -> float:
    """0.013 J per token fed plus 0.0071 J per pass: awkward floats, on purpose."""
    return 0.0071 + 0.013 * sum(len(s.token_ids) for s in desc.seqs)


@dataclass
class EnergyAttention(FakeAttention):
    clocks: list[int] = field(default_factory=lambda: list(A100))
    energies: dict[str, float] = field(default_factory=dict)  # mb_id -> energy_j reported

    async def start(self) -> None:
        await self.nc.subscribe(subjects.attn_mb(self.worker_id), cb=self._on_mb)
        reg = Register(worker_id=self.worker_id, role="attention", model_id="test-model", n_layers=2,
                       kv_total_blocks=self.kv_total_blocks, block_size=self.block_size, max_seq_len=4096,
                       gpu_backend="emulated", gpu_name="A100", supported_clocks_mhz=self.clocks)
        assert decode(RegisterReply, (await self.nc.request(subjects.CONTROL_REGISTER, encode(reg), 5)).data).ok
        self._hb = asyncio.create_task(heartbeat(self.nc, self.worker_id, "attention", self.kv_total_blocks))

    async def _on_mb(self, msg: Msg) -> None:
        desc = decode(MicrobatchDescriptor, msg.data)
        self.descriptors.append(desc)
        if not desc.seqs:
            return
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        results = []
        for seq in desc.seqs:
            if seq.sampling is not None:
                self.generated[seq.seq_id] = len(seq.generated_ids)
            token = None
            if seq.sample:
                n = self.generated.get(seq.seq_id, 0)
                token = self.token(seq.seq_id, n)
                self.generated[seq.seq_id] = n + 1
            results.append(SeqResult(seq_id=seq.seq_id, token_id=token))
        energy = energy_of(desc)
        self.energies[desc.mb_id] = energy
        done = MicrobatchDone(mb_id=desc.mb_id, worker_id=self.worker_id, results=results,
                              kv_free_blocks=self.kv_total_blocks, kv_total_blocks=self.kv_total_blocks)
        data = {**done.model_dump(mode="json"), "energy_j": energy}  # works before and after the field exists
        await self.nc.publish(subjects.SCHED_DONE, orjson.dumps(data))


async def start_ffn_with_clocks(m: Mesh, wid: str, clocks: list[int]) -> None:
    reg = Register(worker_id=wid, role="ffn", model_id="test-model", n_layers=2, supported_clocks_mhz=clocks)
    assert decode(RegisterReply, (await m.nc.request(subjects.CONTROL_REGISTER, encode(reg), 5)).data).ok
    m.ffn_tasks.append(asyncio.create_task(heartbeat(m.nc, wid, "ffn", 0)))


async def listen_freq(m: Mesh) -> dict[str, list[FrequencyCommand]]:
    commands: dict[str, list[FrequencyCommand]] = {}

    async def cb(msg: Msg) -> None:
        cmd = decode(FrequencyCommand, msg.data)
        assert msg.subject == subjects.freq(cmd.worker_id)
        commands.setdefault(cmd.worker_id, []).append(cmd)

    await m.nc.subscribe(f"{subjects.PREFIX}.freq.*", cb=cb)
    return commands


def usage_energy(deltas: list[OutputDelta]) -> float:
    usage = deltas[-1].usage
    assert usage is not None and usage.energy_j is not None
    return usage.energy_j


# -- energy ---------------------------------------------------------------------------------------


def test_request_energy_adds_up_and_is_shared_by_tokens(nats_url: str) -> None:
    async def main() -> None:
        attn = EnergyAttention(None, "a0", delay_s=0.05)  # type: ignore[arg-type]
        async with mesh(nats_url, attn=(attn,), microbatch_depth="1") as m:
            prompts = {"warm": [1, 2], "a": [1, 2, 3], "b": list(range(1, 10)), "c": list(range(1, 6))}
            max_tokens = {"warm": 6, "a": 1, "b": 3, "c": 4}
            queues = {rid: await m.stream(rid) for rid in prompts}
            assert (await m.submit("warm", prompts["warm"], max_tokens=6)).accepted
            await wait_for(lambda: bool(attn.descriptors))  # warm is in flight: a, b, c will batch together
            for rid in ("a", "b", "c"):
                assert (await m.submit(rid, prompts[rid], max_tokens=max_tokens[rid])).accepted
            usage = {rid: usage_energy(await collect(q)) for rid, q in queues.items()}
            await asyncio.sleep(0.1)  # any late release-only descriptor carries no energy
        total = sum(attn.energies.values())
        assert sum(usage.values()) == pytest.approx(total, rel=1e-12)
        expected = dict.fromkeys(prompts, 0.0)
        for desc in attn.descriptors:
            fed = sum(len(s.token_ids) for s in desc.seqs)
            for s in desc.seqs:
                expected[s.seq_id] += attn.energies[desc.mb_id] * len(s.token_ids) / fed
        assert usage == pytest.approx(expected, rel=1e-12)
        shared = [d for d in attn.descriptors if {s.seq_id for s in d.seqs} >= {"a", "b"}]
        assert shared, "a and b never shared a microbatch"
        d = shared[0]
        n = {s.seq_id: len(s.token_ids) for s in d.seqs}
        assert n["a"] == 3 and n["b"] == 9  # a's energy came only from this pass: its token share of it
        assert usage["a"] == pytest.approx(attn.energies[d.mb_id] * 3 / sum(n.values()), rel=1e-12)
    asyncio.run(main())


# -- telemetry ------------------------------------------------------------------------------------


def test_scheduler_telemetry(nats_url: str) -> None:
    async def main() -> None:
        attn = EnergyAttention(None, "a0")  # type: ignore[arg-type]
        async with mesh(nats_url, attn=(attn,), telemetry_hz=20, freq_policy="max", freq_window_s=0.1) as m:
            got: list[SchedulerTelemetry] = []

            async def cb(msg: Msg) -> None:
                got.append(decode(SchedulerTelemetry, msg.data))

            await m.nc.subscribe(subjects.telemetry("scheduler", "scheduler-0"), cb=cb)
            await m.run_request("t1", [1, 2, 3], max_tokens=4)
            await m.run_request("t2", [1, 2], max_tokens=1)
            await wait_for(lambda: any(t.finished >= 2 and t.clocks_mhz for t in got))
            t = next(t for t in got if t.finished >= 2 and t.clocks_mhz)
            assert t.scheduler_id == "scheduler-0" and t.queue_depth == 0 and t.running == 0
            assert t.slo_attainment == 1.0  # the fake worker is far inside the default SLOs
            assert t.ttft_p90_ms is not None and 0 <= t.ttft_p90_ms < 400
            assert t.tpot_p90_ms is not None and 0 <= t.tpot_p90_ms < 120
            assert t.clocks_mhz == {"a0": {"prefill": 1410, "decode": 1410}}  # f0 has no clocks
        async with mesh(nats_url, attn=(EnergyAttention(None, "a0", delay_s=0.02),),  # type: ignore[arg-type]
                        telemetry_hz=20, ttft_slo_ms=1.0) as m:
            got.clear()
            await m.nc.subscribe(subjects.telemetry("scheduler", "scheduler-0"), cb=cb)
            await m.run_request("late", [1, 2, 3], max_tokens=2)
            await wait_for(lambda: any(t.finished >= 1 for t in got))
            assert next(t for t in got if t.finished >= 1).slo_attainment == 0.0  # TTFT over a 1 ms SLO
    asyncio.run(main())


# -- frequency commands ---------------------------------------------------------------------------


def test_policy_max_commands_every_worker_with_clocks(nats_url: str) -> None:
    async def main() -> None:
        a0 = EnergyAttention(None, "a0")  # type: ignore[arg-type]
        bare = EnergyAttention(None, "bare", clocks=[])  # type: ignore[arg-type]
        async with mesh(nats_url, attn=(a0, bare), ffn=(), freq_policy="max", freq_window_s=0.1) as m:
            commands = await listen_freq(m)
            await start_ffn_with_clocks(m, "f0", COARSE)
            await wait_for(lambda: len(commands.get("a0", [])) >= 2 and len(commands.get("f0", [])) >= 2)
            assert "bare" not in commands  # no supported clocks: no commands
            for wid, top in (("a0", 1410), ("f0", 1400)):
                for cmd in commands[wid]:
                    assert cmd.clocks_mhz == {"prefill": top, "decode": top}
                    assert cmd.valid_until_ts - cmd.issued_ts == pytest.approx(0.3)
                    assert abs(cmd.issued_ts - time.time()) < 5
    asyncio.run(main())


def test_policy_fixed_uses_the_configured_clocks(nats_url: str) -> None:
    async def main() -> None:
        async with mesh(nats_url, attn=(EnergyAttention(None, "a0"),), ffn=(),  # type: ignore[arg-type]
                        freq_policy="fixed", freq_window_s=0.1,
                        fixed_clocks="attention.decode=900,ffn.decode=1200,ffn.prefill=1000") as m:
            commands = await listen_freq(m)
            await start_ffn_with_clocks(m, "f0", A100)
            await wait_for(lambda: bool(commands.get("a0")) and bool(commands.get("f0")))
            assert commands["a0"][-1].clocks_mhz == {"prefill": 1410, "decode": 900}
            assert commands["f0"][-1].clocks_mhz == {"prefill": 990, "decode": 1200}  # snapped to the table
    asyncio.run(main())


def test_policy_slo_steps_down_when_fast_and_up_when_slow(nats_url: str) -> None:
    async def main() -> None:
        a0 = EnergyAttention(None, "a0", clocks=COARSE)  # type: ignore[arg-type]
        async with mesh(nats_url, attn=(a0,), ffn=(), freq_policy="slo", freq_window_s=0.2,
                        ttft_slo_ms=300, tpot_slo_ms=40) as m:
            commands = await listen_freq(m)
            await start_ffn_with_clocks(m, "f0", COARSE)
            stop = asyncio.Event()

            async def load() -> None:  # one request after another, so every window sees tokens
                i = 0
                while not stop.is_set():
                    await m.run_request(f"s{i}", [1, 2, 3], max_tokens=6)
                    i += 1

            loader = asyncio.create_task(load())
            try:
                def decode_clocks(wid: str) -> list[int]:
                    return [c.clocks_mhz["decode"] for c in commands.get(wid, [])]

                await wait_for(lambda: 600 in decode_clocks("a0") and 600 in decode_clocks("f0"), 6)
                down = decode_clocks("a0")
                # it starts at the maximum and steps down to the minimum (a loaded machine may see a
                # late token on the way and step up once, so the path need not be monotonic)
                assert down[0] > 600 and down[-1] == 600
                assert down[0] == 1400 or len(set(down)) > 2  # started at max (or we joined late)
                a0.delay_s = 0.06  # now TPOT ~60 ms > 40 ms: every window misses
                seen = {wid: len(decode_clocks(wid)) for wid in ("a0", "f0")}
                for wid in ("a0", "f0"):
                    await wait_for(lambda w=wid: max(decode_clocks(w)[seen[w]:], default=0) >= 1200, 6)
            finally:
                stop.set()
                a0.delay_s = 0.0
                await asyncio.wait_for(loader, 5)
    asyncio.run(main())

"""The scheduler's `aflex` clock policy: shared/policy's clock selection driving the frequency commands.

Pure tests of services/scheduler/aflex.py first; then the scheduler on a real nats-server with
tests/test_scheduler.py's fake workers registered as emulated A800s, serving a model with the shape
of Qwen3-32B (the fake workers' timings are not GPU time: the plans come from the predictors and
the scheduler's own view of the load). Expected clocks are the policy function's own answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from loadgen.sim.models import get_model
from services.scheduler.aflex import AflexPlanner, IterationSample, representative, sample_of
from services.scheduler.model_info import ModelInfo
from services.scheduler.profiles import guess_profile
from services.scheduler.service import Scheduler
from services.worker_base.presence import registration
from shared import subjects
from shared.gpu.emulated import EmulatedGPU, available_profiles, load_profile
from shared.gpu.snap import snap_clock
from shared.kinds import CLOCK_PHASES
from shared.messages import (
    FrequencyCommand,
    OutputDelta,
    Register,
    RegisterReply,
    SamplingSpec,
    SubmitReply,
    SubmitRequest,
    decode,
    encode,
)
from shared.perf import OPS, cached_predictor
from shared.policy import BatchStats, ClockRule, OperatingPoint, PoolShape, choose_operating_point
from shared.settings import SchedulerSettings
from tests.services.scheduler.test_scheduler import FakeAttention, heartbeat, wait_for

QWEN = get_model("qwen3-32b")
AFLEX_RULE = ClockRule(objective="idle-aware")  # the simulator's aflex clock rule (policy_spec("aflex"))
MODEL = ModelInfo("test-model", frozenset({2}), vocab_size=1000, max_seq_len=4096, args=QWEN)
A800 = load_profile("a800")
A800_CLOCKS = A800.clocks_mhz


# -- pure -----------------------------------------------------------------------------------------


def test_guess_profile() -> None:
    keys = available_profiles()
    assert guess_profile("a800", "whatever", keys) == "a800"
    assert guess_profile("", "NVIDIA H200", keys) == "h200"
    assert guess_profile("", "NVIDIA A100-SXM4-80GB", keys) == "a100"
    assert guess_profile("", "emulated A800-SXM4-80GB", keys) == "a800"
    assert guess_profile("nope", "Mystery GPU", keys) is None and guess_profile("", "", keys) is None
    reg = registration("f0", "ffn", "m", 2, gpu=EmulatedGPU("a800"))
    assert reg.gpu_profile == "a800"


def test_sample_and_representative() -> None:
    # (n_new, start, samples, is_decode, prompt_len)
    dec = sample_of([(1, 10, True, True, 5), (1, 20, True, True, 9)], 0.0)
    assert dec.phase == "decode" and dec.n_tokens == 2 and dec.ctx_tokens == 32 and dec.pairs == 32
    mixed = sample_of([(1, 10, True, True, 5), (8, 0, True, False, 8)], 0.0)
    assert mixed.phase == "prefill" and mixed.max_prompt == 8 and mixed.pairs == 11 + 36
    window = [IterationSample(0.0, "decode", n, n * 10.0, n * 10.0, n, n, 0) for n in range(1, 11)]
    rep = representative(window, "decode")
    assert rep is not None and rep.n_tokens == 9 and representative(window, "prefill") is None


def planner() -> AflexPlanner:
    return AflexPlanner(QWEN, ttft_slo_ms=400, tpot_slo_ms=120, depths=(1, 2, 3, 4))


def test_plan_pair_is_the_policy_and_misses_raise_clocks() -> None:
    pl = planner()
    window = [IterationSample(0.0, "decode", 1, 30.0, 30.0, 1, 1, 0)]
    plan = pl.plan_pair(A800, "decode", window)
    assert plan is not None and plan.budget_s == pytest.approx(0.120 * (1 - pl.margins["decode"].margin))
    pred = cached_predictor(A800, QWEN)
    expected = choose_operating_point(pred, PoolShape(split=True), BatchStats("decode", 1, 30, 30, 1), plan.budget_s,
                              AFLEX_RULE)
    assert plan.op == expected and pl.rule.objective == "idle-aware"
    # energy above the idle floor, not the iteration's total: here a slower decode point than the old rule's
    total = choose_operating_point(pred, PoolShape(split=True), BatchStats("decode", 1, 30, 30, 1), plan.budget_s,
                           ClockRule())
    assert plan.op.clock_attention + plan.op.clock_ffn < total.clock_attention + total.clock_ffn
    # prefill iterations keep the whole-iteration objective
    pre = [IterationSample(0.0, "prefill", 512, 512.0, 512.0 * 513 / 2, 1, 0, 512)]
    pplan = pl.plan_pair(A800, "prefill", pre)
    assert pplan is not None
    assert pplan.op == choose_operating_point(pred, PoolShape(split=True), pre[0].stats, pplan.budget_s, ClockRule())
    # a batch whose time follows the clock, an SLO just above its unconstrained optimum: misses widen
    # the margin until the optimum no longer fits, and the clocks rise
    big = [IterationSample(0.0, "decode", 128, 128 * 25.0, 128 * 25.0, 128, 128, 0)]
    best = choose_operating_point(pred, PoolShape(split=True), big[0].stats, 1e9, AFLEX_RULE)
    tight = AflexPlanner(QWEN, ttft_slo_ms=400, tpot_slo_ms=best.time_s * 1e3 / 0.8, depths=(1, 2, 3, 4))
    before = tight.plan_pair(A800, "decode", big)
    for _ in range(6):
        tight.update_margins({"decode": (200.0, 10, 10)})
    after = tight.plan_pair(A800, "decode", big)
    assert before is not None and after is not None
    assert after.budget_s < before.budget_s
    # a tighter budget may rebalance (attention down, FFN up): the clocks rise in sum and peak
    b_op, a_op = before.op, after.op
    assert a_op.clock_attention + a_op.clock_ffn > b_op.clock_attention + b_op.clock_ffn
    assert max(a_op.clock_attention, a_op.clock_ffn) > max(b_op.clock_attention, b_op.clock_ffn)
    assert a_op.time_s <= after.budget_s


def test_observe_corrects_within_bounds() -> None:
    pl = planner()
    s = IterationSample(0.0, "decode", 8, 800.0, 800.0, 8, 8, 0)
    pred = pl.predictor(A800)
    assert pred is not cached_predictor(A800, QWEN)  # own corrections, shared fits
    t = pred.predict_at("attention", "decode", 8, 800, 800, 1410) * QWEN.n_layers
    for _ in range(200):
        pl.observe(A800, "decode", s, attention_s=100 * t, ffn_wait_s=0.0, clock_attention=1410, clock_ffn=None,
                   lone=True)
    assert pred.correction[("attention", "decode")] == pytest.approx(pl.max_correction)
    tf = pred.predict_at("ffn", "decode", 8, 0, 0, 900) * QWEN.n_layers
    pl.observe(A800, "decode", s, attention_s=0.0, ffn_wait_s=0.0, clock_attention=None, clock_ffn=900,
               lone=False, ffn_compute_s=1.3 * tf)  # the FFN's own compute: observed at any depth
    assert pred.correction[("ffn", "decode")] == pytest.approx(1 + pred.alpha * 0.3)
    assert cached_predictor(A800, QWEN).correction.get(("attention", "decode"), 1.0) == 1.0


# -- live -----------------------------------------------------------------------------------------


@dataclass
class ProfiledAttention(FakeAttention):
    gpu_profile: str = "a800"
    gpu_name: str = "emulated A800-SXM4-80GB"
    clocks: list[int] = field(default_factory=lambda: list(A800_CLOCKS))

    async def start(self) -> None:
        await self.nc.subscribe(subjects.attn_mb(self.worker_id), cb=self._on_mb)
        reg = Register(worker_id=self.worker_id, role="attention", model_id="test-model", n_layers=2,
                       kv_total_blocks=self.kv_total_blocks, block_size=self.block_size, max_seq_len=4096,
                       gpu_backend="emulated", gpu_name=self.gpu_name, gpu_profile=self.gpu_profile,
                       supported_clocks_mhz=self.clocks)
        assert decode(RegisterReply, (await self.nc.request(subjects.CONTROL_REGISTER, encode(reg), 5)).data).ok
        self._hb = asyncio.create_task(heartbeat(self.nc, self.worker_id, "attention", self.kv_total_blocks))


@dataclass
class Live:
    nc: Client
    sched: Scheduler
    commands: dict[str, list[FrequencyCommand]]
    tasks: list[asyncio.Task[None]]

    async def ffn(self, wid: str, gpu_profile: str = "a800", gpu_name: str = "emulated A800-SXM4-80GB") -> None:
        reg = Register(worker_id=wid, role="ffn", model_id="test-model", n_layers=2, gpu_backend="emulated",
                       gpu_name=gpu_name, gpu_profile=gpu_profile, supported_clocks_mhz=list(A800_CLOCKS))
        assert decode(RegisterReply, (await self.nc.request(subjects.CONTROL_REGISTER, encode(reg), 5)).data).ok
        self.tasks.append(asyncio.create_task(heartbeat(self.nc, wid, "ffn", 0)))

    async def submit(self, rid: str, prompt_len: int, max_tokens: int) -> asyncio.Event:
        done = asyncio.Event()

        async def cb(msg: Msg) -> None:
            if decode(OutputDelta, msg.data).finish_reason is not None:
                done.set()

        await self.nc.subscribe(subjects.req_out(rid), cb=cb)
        req = SubmitRequest(request_id=rid, model="test-model", prompt_ids=[5] * prompt_len,
                            sampling=SamplingSpec(max_tokens=max_tokens, ignore_eos=True), arrival_ts=time.time())
        reply = decode(SubmitReply, (await self.nc.request(subjects.REQ_SUBMIT, encode(req), 5)).data)
        assert reply.accepted, reply
        return done


@contextlib.asynccontextmanager
async def live(url: str, attn: FakeAttention, model: ModelInfo = MODEL, **settings: object) -> AsyncIterator[Live]:
    """A scheduler (serving `model`'s shape) whose frequency windows the test runs itself (`freq_window_s` is long)."""
    sched_nc = await nats.connect(url)
    nc = await nats.connect(url)
    s = SchedulerSettings(nats_url=url, **{"freq_window_s": 30.0, "telemetry_hz": 0, **settings})  # type: ignore[arg-type]
    sched = Scheduler(s, sched_nc, model)
    await sched.start()
    commands: dict[str, list[FrequencyCommand]] = {}

    async def cb(msg: Msg) -> None:
        cmd = decode(FrequencyCommand, msg.data)
        commands.setdefault(cmd.worker_id, []).append(cmd)

    await nc.subscribe(f"{subjects.PREFIX}.freq.*", cb=cb)
    deadline = time.monotonic() + 5
    while True:  # the scheduler is reachable once it answers status
        try:
            await nc.request(subjects.SCHED_STATUS, b"", 2)
            break
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
    attn.nc = nc
    await attn.start()
    lv = Live(nc, sched, commands, [])
    try:
        yield lv
    finally:
        attn.stop_heartbeat()
        for t in lv.tasks:
            t.cancel()
        await sched.stop()
        await sched_nc.close()
        await nc.close()


def test_a_worker_is_registered_once_its_gpus_tables_are_fitted(nats_url: str) -> None:
    """The predictor's fits (~0.6 s a GPU profile) are made while the first worker of a profile registers, so
    that the first request never waits for them on the scheduler's loop."""
    async def main() -> None:
        cached_predictor.cache_clear()  # what this process's earlier tests fitted
        async with live(nats_url, ProfiledAttention(None, "a0")):  # type: ignore[arg-type]
            fitted = set(cached_predictor(A800, QWEN)._fits)  # the fits the scheduler's planner shares
            assert {(op, phase, 1) for op in OPS for phase in CLOCK_PHASES} <= fitted
    asyncio.run(main())


def test_a_worker_registers_even_when_its_gpus_tables_cannot_be_fitted(nats_url: str, caplog: pytest.LogCaptureFixture,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def cannot_fit(self: AflexPlanner, profile: object) -> None:
        raise RuntimeError("no fits today")

    monkeypatch.setattr(AflexPlanner, "warm", cannot_fit)

    async def main() -> None:
        with caplog.at_level(logging.WARNING, logger="aflex.scheduler"):
            async with live(nats_url, ProfiledAttention(None, "a0")) as lv:  # type: ignore[arg-type]
                assert "a0" in lv.sched.registry.workers  # answered and registered
        assert "no fits today" in caplog.text and "a0 registers anyway" in caplog.text
    asyncio.run(main())


def test_aflex_commands_follow_the_policy_under_a_large_decode_batch(nats_url: str) -> None:
    async def main() -> None:
        a0 = ProfiledAttention(None, "a0", kv_total_blocks=20000, delay_s=0.01)  # type: ignore[arg-type]
        async with live(nats_url, a0, max_num_seqs=256) as lv:
            await lv.ffn("f0")
            await wait_for(lambda: bool(lv.commands.get("a0")) and bool(lv.commands.get("f0")))
            assert lv.commands["a0"][0].clocks_mhz == {"prefill": 1410, "decode": 1410}  # start at max
            assert lv.commands["a0"][0].reason.startswith("aflex")
            dones = await asyncio.gather(*(lv.submit(f"r{i}", 10, 40) for i in range(200)))
            await wait_for(lambda: sum(s.phase == "decode" and s.n_tokens >= 150
                                       for s in lv.sched.governor.samples.get("a0", ())) >= 5, 10)
            n = len(lv.commands["a0"])
            await lv.sched.freq_window()
            await wait_for(lambda: len(lv.commands["a0"]) > n and len(lv.commands["f0"]) > n)
            rec = lv.sched.governor.plans["a0"]["decode"]
            assert rec.stats.phase == "decode" and rec.stats.n_tokens >= 150
            pred = cached_predictor(A800, QWEN)  # no timings reported: no correction either
            op = choose_operating_point(pred, PoolShape(split=True), rec.stats, rec.budget_s, AFLEX_RULE, rec.current)
            assert op == rec.op
            # the per-step budget, widened by whatever a0's running requests banked (how much depends on how fast
            # this machine served them: `test_decode_slack.py` checks the widening itself), never below the step's
            # budget, never past the TTFT SLO (shared.policy.decode_slack)
            step = 0.120 * (1 - lv.sched.governor.planner.margins["decode"].margin)  # type: ignore[union-attr]
            assert step <= rec.budget_s <= 0.400
            a_cmd, f_cmd = lv.commands["a0"][-1].clocks_mhz, lv.commands["f0"][-1].clocks_mhz
            assert a_cmd["decode"] == snap_clock(A800_CLOCKS, op.clock_attention, "up")
            assert f_cmd["decode"] == snap_clock(A800_CLOCKS, op.clock_ffn, "up")
            if op.clock_attention < op.clock_ffn:  # memory-bound decode attention: the policy slows it more
                assert a_cmd["decode"] < f_cmd["decode"]
            # the policy's depth now cuts the decode iterations
            k = len(lv.sched.governor.samples["a0"])
            await wait_for(lambda: len(lv.sched.governor.samples["a0"]) > k + 2, 10)
            latest = [s for s in list(lv.sched.governor.samples["a0"])[k:]
                      if s.phase == "decode" and s.n_tokens >= op.depth]
            assert latest and all(s.depth == op.depth for s in latest)
            await asyncio.wait_for(asyncio.gather(*(d.wait() for d in dones)), 15)
    asyncio.run(main())


def test_aflex_clocks_rise_after_misses(nats_url: str) -> None:
    # what each round's decode looks like: short prompts, so the prefill cap admits a round at once
    nominal = BatchStats("decode", 128, 128 * 6, 128 * 6, 128)
    pred = cached_predictor(A800, QWEN)
    best = choose_operating_point(pred, PoolShape(split=True), nominal, 1e9, AFLEX_RULE)
    tpot_slo_ms = best.time_s * 1e3 / 0.8  # fits the optimum at the starting margin, not at a wide one

    def time_at(op: OperatingPoint, stats: BatchStats) -> float:
        """The predicted decode iteration time of `op`'s clocks for a batch like `stats`."""
        pinned = dataclasses.replace(AFLEX_RULE, depths=(op.depth,),
                                     fixed_mhz=((op.clock_attention, op.clock_ffn),) * 2)
        return choose_operating_point(pred, PoolShape(split=True), stats, 1e9, pinned).time_s

    async def main() -> None:
        a0 = ProfiledAttention(None, "a0", kv_total_blocks=20000)  # type: ignore[arg-type]
        async with live(nats_url, a0, tpot_slo_ms=tpot_slo_ms, microbatch_depth="1") as lv:
            await lv.ffn("f0")
            rounds = windows = 0

            async def burst() -> None:  # 128 requests decoding together
                nonlocal rounds
                rounds += 1
                dones = await asyncio.gather(*(lv.submit(f"b{rounds}-{i}", 2, 5) for i in range(128)))
                await asyncio.wait_for(asyncio.gather(*(d.wait() for d in dones)), 15)

            async def window() -> None:
                nonlocal windows
                windows += 1
                await lv.sched.freq_window()

            def decode_clocks() -> tuple[int, int]:
                return lv.commands["a0"][-1].clocks_mhz["decode"], lv.commands["f0"][-1].clocks_mhz["decode"]

            await burst()
            await window()
            await wait_for(lambda: all(len(lv.commands.get(w, [])) > windows for w in ("a0", "f0")))
            first, first_plan = decode_clocks(), lv.sched.governor.plans["a0"]["decode"]
            a0.delay_s = 2 * tpot_slo_ms / 1e3  # every token now misses the TPOT SLO
            for _ in range(3):
                await burst()
                await window()
            # The misses widen the margin until the first clocks no longer fit the budget. How many windows
            # that takes depends on the first plan: a first round admitted in parts decodes a shorter
            # context, whose least-energy point can already be fast (seen: A 300 / F 930 MHz, 82 ms).
            for _ in range(8):
                plan = lv.sched.governor.plans["a0"]["decode"]
                if plan.budget_s < time_at(first_plan.op, plan.stats):
                    break
                await window()
            await wait_for(lambda: all(len(lv.commands[w]) > windows for w in ("a0", "f0")))
            last, plan = decode_clocks(), lv.sched.governor.plans["a0"]["decode"]
            reasons = [c.reason for c in lv.commands["a0"]]
            assert lv.sched.governor.planner is not None and lv.sched.governor.planner.margins["decode"].margin > 0.3
            assert plan.budget_s < first_plan.budget_s and plan.op.feasible and plan.op.time_s <= plan.budget_s
            # Faster clocks for a tighter budget. Not each clock: at a tighter budget the least-energy split
            # may move one operator down while the other goes up (seen: A 300 -> 210, F 480 -> 1020 MHz).
            assert plan.budget_s < time_at(first_plan.op, plan.stats), (first, reasons)
            assert last == (snap_clock(A800_CLOCKS, plan.op.clock_attention, "up"),
                            snap_clock(A800_CLOCKS, plan.op.clock_ffn, "up")), reasons
            assert last != first and time_at(plan.op, plan.stats) < time_at(first_plan.op, plan.stats), reasons
    asyncio.run(main())


def test_unknown_profile_falls_back_to_slo(nats_url: str, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        a0 = ProfiledAttention(None, "a0", gpu_profile="", gpu_name="Mystery GPU")  # type: ignore[arg-type]
        with caplog.at_level(logging.WARNING, logger="aflex.scheduler"):
            async with live(nats_url, a0) as lv:
                await lv.ffn("f0")
                await wait_for(lambda: bool(lv.commands.get("a0")) and bool(lv.commands.get("f0")))
                await (await lv.submit("x", 5, 3)).wait()
                await lv.sched.freq_window()
                await wait_for(lambda: len(lv.commands["a0"]) >= 2 and len(lv.commands["f0"]) >= 2)
                assert all(c.reason.startswith("slo") and "aflex fallback" in c.reason for c in lv.commands["a0"])
                assert all(c.reason.startswith("aflex") for c in lv.commands["f0"])  # f0's profile is known
        assert any("a0 falls back to slo" in r.getMessage() for r in caplog.records)
    asyncio.run(main())

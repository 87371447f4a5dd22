"""The global scheduler, live (issue 26): every provisioning window, the simulator's plan over the live workers.

Pure tests of services/scheduler/fleet_plan.py first: the load is the simulator's rule on the same
arrivals, the plan is `elastic_plan`'s on the same load and cluster, the workers' assignments are
stable. Then the scheduler on a real nats-server with fake workers registered as emulated A800s,
serving a model with the shape of Qwen3-32B (the plans come from the predictors and the load the
scheduler admitted): quiet, it parks all but one attention and one FFN worker at their lowest clock;
under a burst it wakes them; new requests never go to a parked worker; every request finishes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
from nats.aio.msg import Msg

from loadgen.sim.models import get_model
from services.scheduler.fleet_plan import LoadLog, Provisioner, assign
from shared import subjects
from shared.gpu.emulated import load_profile
from shared.kinds import PLAN_KINDS, Role
from shared.messages import (
    KVHandoff,
    KVHandoffReply,
    PlanTelemetry,
    Register,
    RegisterReply,
    RoleAssignment,
    SeqWork,
    decode,
    encode,
)
from shared.perf import cached_predictor
from shared.policy import SHARED_CLOCK_OBJECTIVE, ClockRule, Plan, PoolShape, WindowLoad
from shared.policy.footprint import elastic_plan
from shared.policy.pool_sizing import LiveGroups
from shared.policy.window_load import window_load
from tests.services.scheduler.test_scheduler import heartbeat, wait_for
from tests.services.scheduler.test_scheduler_policy import A800_CLOCKS, ProfiledAttention, live

QWEN = get_model("qwen3-32b")
A800 = load_profile("a800")
RULE = ClockRule(objective=SHARED_CLOCK_OBJECTIVE)


def _provisioner(window_s: float = 60.0, parking: str = "warm") -> Provisioner:
    return Provisioner(window_s=window_s, ttft_slo_ms=400, tpot_slo_ms=120, link_bytes_s=400e9, parking=parking)


def test_the_live_load_is_the_simulators_rule_on_the_same_arrivals() -> None:
    rng = np.random.default_rng(0)
    times = np.sort(rng.uniform(0, 60, 80))
    prompts, outputs = rng.integers(50, 900, 80), rng.integers(5, 300, 80)
    log = LoadLog(keep_s=60.0)
    for i, (t, p) in enumerate(zip(times, prompts, strict=True)):
        log.admitted(f"r{i}", 1000.0 + t, int(p), 512)
    for i, o in enumerate(outputs):
        log.finished(f"r{i}", int(o))
    got = log.load(1060.0, 60.0, 10.0, 0.9)
    want = window_load(times, prompts, outputs, 0.0, 60.0, burst=True, subwindow_s=10.0, quantile=0.9)
    assert got == pytest.approx(want)
    assert got.rate_rps > len(times) / 60  # the bursts, not the mean
    # one still running counts the mean output of those that finished; none finished: its max_tokens
    log.admitted("late", 1059.0, 100, 512)
    assert log.load(1060.0, 60.0, 10.0, 0.9).mean_output == pytest.approx(float(np.mean([*outputs, outputs.mean()])))
    fresh = LoadLog(keep_s=60.0)
    fresh.admitted("x", 5.0, 100, 77)
    assert fresh.load(6.0, 60.0, 10.0, 0.9).mean_output == 77
    assert fresh.load(100.0, 60.0, 10.0, 0.9).rate_rps == pytest.approx(0.05)  # pruned: the idle rate


def test_the_live_plan_is_the_simulators_call_over_the_live_workers() -> None:
    pv = _provisioner()
    pred = cached_predictor(A800, QWEN)
    for i in range(30):  # 0.5 req/s of 200-token prompts: one attention and one FFN worker hold it
        pv.loads.admitted(f"r{i}", 100.0 + 2 * i, 200, 400)
    attention, ffn = ["a0", "a1", "a2", "a3"], ["f0", "f1"]
    decision = pv.plan(160.0, pred, RULE, attention, ffn)
    spec = pv.spec(QWEN, A800, LiveGroups.ones(4, 2))
    want = elastic_plan(pred, decision.load, spec, RULE, 1.3, None, kinds=PLAN_KINDS)
    assert decision.plan == want and decision.plan.kind == "mixed" and decision.plan.gpus == 2
    assert spec.max_attention == 4 and spec.max_ffn == 2 and spec.parked_power_w == A800.warm_parked_power_w
    assert decision.assignments == {"a0": "mixed-attention", "a1": "parked-warm", "a2": "parked-warm",
                                    "a3": "parked-warm", "f0": "ffn", "f1": "parked-warm"}
    assert decision.changed == sorted(decision.assignments) and decision.plan_id == 1
    # a burst of long decodes (16 req/s in a 4-second window) needs more attention workers
    pv.window_s = pv.loads.keep_s = 4.0
    pv.subwindow_s = 2.0
    for i in range(32):
        pv.loads.admitted(f"b{i}", 161.0 + i / 16, 200, 400)
    busy = pv.plan(163.0, pred, RULE, attention, ffn, kinds=("mixed",))  # (with P/D too it overflows: P/D)
    assert busy.load.rate_rps == pytest.approx(np.quantile([0.0, 16.0], 0.9))  # two 2-second sub-windows
    assert busy.plan == elastic_plan(pred, busy.load, spec, RULE, 1.3, "mixed", kinds=("mixed",))
    assert busy.plan.mixed is not None and busy.plan.mixed.attention >= 2
    assert busy.assignments["a0"] == "mixed-attention"  # kept where it was
    assert set(busy.changed) <= {"a1", "a2", "a3", "f1"} and busy.changed


def test_a_pd_plan_names_prefill_and_decode_workers_each_pool_with_its_ffn() -> None:
    pv = _provisioner()
    pred = cached_predictor(A800, QWEN)
    for i in range(30):
        pv.loads.admitted(f"r{i}", 100.0 + 2 * i, 200, 400)
    d = pv.plan(160.0, pred, RULE, ["a0", "a1", "a2", "a3"], ["f0", "f1"], kinds=("pd",))
    assert d.plan.kind == "pd" and d.plan.prefill is not None and d.plan.decode is not None
    spec = pv.spec(QWEN, A800, LiveGroups.ones(4, 2))
    assert d.plan == elastic_plan(pred, d.load, spec, RULE, 1.3, None, kinds=("pd",))
    roles = sorted(d.assignments.values())
    assert roles.count("prefill-attention") == d.plan.prefill.attention
    assert roles.count("decode-attention") == d.plan.decode.attention
    assert {d.pool_of[w] for w, a in d.assignments.items() if a == "ffn"} == {"prefill", "decode"}
    assert all(d.pool_of[w] == ("prefill" if a == "prefill-attention" else "decode")
               for w, a in d.assignments.items() if a.endswith("-attention"))


def test_a_pd_plan_that_overflows_its_ffn_workers_gives_way_to_a_mixed_pool_that_holds_the_load() -> None:
    """Each worker holds one half: P/D needs an FFN worker per pool, and with 2 FFN workers a burst overflows
    the decode pool's, where one mixed pool shares them (2 FFN workers, 2 or 3 attention workers as the
    groups' collectives price it) and holds it (`elastic_plan`: a feasible kind is taken over an overflowing
    split)."""
    pv = _provisioner(window_s=1.0)
    pred = cached_predictor(A800, QWEN)
    for i in range(10):
        pv.loads.admitted(f"b{i}", 100.0 + i / 80, 200, 400)
    pd_only = pv.plan(100.6, pred, RULE, ["a0", "a1", "a2", "a3"], ["f0", "f1"], kinds=("pd",))
    assert pd_only.plan.kind == "pd" and not pd_only.plan.feasible
    either = pv.plan(100.6, pred, RULE, ["a0", "a1", "a2", "a3"], ["f0", "f1"], kinds=("mixed", "pd"))
    assert either.plan.kind == "mixed" and either.plan.feasible and either.plan.mixed is not None
    # it says why: it weighed both kinds, and the P/D plan could not hold the load
    assert set(either.weighed) == {"mixed", "pd"} and not either.weighed["pd"].feasible
    assert either.plan.mixed.ffn == 2 and either.plan.mixed.attention >= 2


def test_a_pd_plan_of_whole_model_workers_needs_no_ffn_worker_and_takes_replicas_of_their_size() -> None:
    """The "pd-colocated" kind live: four TP2 whole-model workers and no FFN worker; the plan is the
    simulator's call over them (`provision_pd` limited to the workers it has), and each pool's replicas are
    workers of its TP, told to run their own FFN half (`prefill-colocated`, `decode-colocated`)."""
    pv = _provisioner()
    pred = cached_predictor(A800, QWEN)
    for i in range(30):
        pv.loads.admitted(f"r{i}", 100.0 + 2 * i, 200, 400)
    whole = ["w0", "w1", "w2", "w3"]
    sizes = dict.fromkeys(whole, 2)
    d = pv.plan(160.0, pred, RULE, whole, [], kinds=("pd-colocated",), colocate_ids=whole, sizes=sizes)
    spec = pv.spec(QWEN, A800, LiveGroups((2,) * 4, (), (2,) * 4))
    assert d.plan == elastic_plan(pred, d.load, spec, RULE, 1.3, None, kinds=("pd-colocated",))
    assert d.plan.kind == "pd-colocated" and d.plan.prefill is not None and d.plan.decode is not None
    assert d.plan.prefill.tp == d.plan.decode.tp == 2  # the only replicas these workers form
    roles = sorted(d.assignments.values())
    assert roles.count("prefill-colocated") == d.plan.prefill.replicas
    assert roles.count("decode-colocated") == d.plan.decode.replicas
    assert all(d.pool_of[w] == a.split("-")[0] for w, a in d.assignments.items() if a.endswith("-colocated"))
    # more replicas than the workers have are never planned, whatever the load
    for i in range(200):
        pv.loads.admitted(f"b{i}", 161.0 + i / 50, 2000, 400)
    busy = pv.plan(165.0, pred, RULE, whole, [], kinds=("pd-colocated",), colocate_ids=whole, sizes=sizes)
    assert busy.plan.prefill is not None and busy.plan.decode is not None
    assert busy.plan.prefill.replicas + busy.plan.decode.replicas <= 4
    with pytest.raises(ValueError, match="an attention worker holding both halves"):
        pv.plan(165.0, pred, RULE, whole, [], kinds=("pd-colocated",))  # none holds the FFN half


def test_a_kind_whose_requests_missed_tpot_at_a_load_its_plan_held_is_not_returned_to() -> None:
    """The live side of `PowerCorrection.barred`: the requests that came in the stretch of the plan in force
    finished over the TPOT SLO, at a load it was sized for; the next plan takes another kind that holds the
    load, and keeps away from it at that load (the simulator's rule: `slo_window.stretch_tpot_met`)."""
    pv = _provisioner()
    pred = cached_predictor(A800, QWEN)
    whole = ["w0", "w1", "w2", "w3"]
    kinds = ("colocated", "pd-colocated")

    def plan(now: float) -> str:
        for i in range(6):  # the same quiet load every time
            pv.loads.admitted(f"r{now}-{i}", now - 50.0 + 8 * i, 200, 400)
        return pv.plan(now, pred, RULE, whole, [], kinds=kinds, colocate_ids=whole,
                       sizes=dict.fromkeys(whole, 2)).plan.kind  # TP2 whole-model workers

    first = plan(160.0)
    assert plan(220.0) == first  # met (no TPOT seen yet): kept
    pv.finished_tpot(250.0, 230.0, 0.05)  # within 120 ms
    assert plan(280.0) == first and not pv.power.correction.failed_at_rps
    for i in range(10):
        pv.finished_tpot(320.0 + i, 290.0 + i, 0.3)  # every request of this stretch at 300 ms a token
    assert plan(340.0) != first and first in pv.power.correction.failed_at_rps
    pv.finished_tpot(345.0, 341.0, 0.01)
    assert plan(400.0) != first  # not returned to at this load


def test_pd_pools_are_weighed_only_where_the_mesh_holds_them() -> None:
    from services.scheduler.plan_loop import ProvisioningLoop
    from services.scheduler.registry import Worker
    from shared.settings import SchedulerSettings

    def kinds(setting: str, n_attention: int, n_ffn: int, kv_address: str = "gloo://h:1") -> tuple[str, ...]:
        loop = ProvisioningLoop.__new__(ProvisioningLoop)
        loop.settings = SchedulerSettings(provision_kinds=setting)  # type: ignore[arg-type]
        attention = [Worker(f"a{i}", "attention", kv_address=kv_address, halves=halves) for i in range(n_attention)]
        return loop.kinds(attention, [Worker(f"f{i}", "ffn") for i in range(n_ffn)])

    halves: tuple[Role, ...] = ()

    assert kinds("auto", 2, 2) == ("mixed", "pd")
    assert kinds("pd", 2, 2) == ("pd",)
    assert kinds("mixed", 4, 2) == ("mixed",)
    assert kinds("pd", 2, 1) == ("mixed",)  # a P/D plan needs an FFN worker per pool
    assert kinds("auto", 2, 2, kv_address="") == ("mixed",)  # the nats seam: no KV seam to hand off to
    halves = ("ffn",)  # whole-model workers: replicas, and P/D pools of two or more of them
    assert kinds("auto", 2, 2) == ("mixed", "pd", "colocated", "pd-colocated")
    assert kinds("auto", 2, 0) == ("colocated", "pd-colocated") and kinds("pd-colocated", 2, 0) == ("pd-colocated",)
    assert kinds("pd-colocated", 1, 0) == ("colocated",) and kinds("auto", 2, 0, kv_address="") == ("colocated",)


def test_workers_out_of_the_plan_park_cold_where_the_window_pays_for_the_reload() -> None:
    """The simulator's rule (`parking_state`): cold when the window's saving (warm-parked less bare idle
    power) pays for the model load that brings it back (context-idle power over `cold_rejoin_s`)."""
    from shared.model.sizes import attention_weight_bytes, ffn_weight_bytes
    from shared.policy.parking_rule import model_parking_state, parked_power_w, parking_state

    cold_j = A800.context_idle_power_w * A800.cold_rejoin_s((attention_weight_bytes(QWEN) + ffn_weight_bytes(QWEN)) / 2)
    break_even_s = cold_j / (A800.warm_parked_power_w - A800.idle_power_w)
    for window_s in (break_even_s / 2, break_even_s * 2, 300.0):
        pv = _provisioner(window_s, parking="auto")
        want = parking_state("auto", window_s, A800.warm_parked_power_w, A800.idle_power_w, cold_j)
        assert pv.parked_state(QWEN, A800) == f"parked-{want}"
        assert pv.spec(QWEN, A800, LiveGroups.ones(4, 2)).parked_power_w == (A800.idle_power_w if want == "cold"
                                                               else A800.warm_parked_power_w)
        # the one rule the simulator's engine calls too
        assert model_parking_state("auto", A800, QWEN, window_s) == want
        assert parked_power_w(want, A800) == pv.spec(QWEN, A800, LiveGroups.ones(4, 2)).parked_power_w
    assert _provisioner(300.0, parking="auto").parked_state(QWEN, A800) == "parked-cold"
    assert _provisioner(1.0, parking="auto").parked_state(QWEN, A800) == "parked-warm"
    pv = _provisioner(300.0, parking="cold")
    for i in range(30):
        pv.loads.admitted(f"r{i}", 100.0 + 2 * i, 200, 400)
    d = pv.plan(160.0, cached_predictor(A800, QWEN), RULE, ["a0", "a1"], ["f0", "f1"], kinds=("mixed",))
    assert sorted(d.assignments.values()) == ["ffn", "mixed-attention", "parked-cold", "parked-cold"]
    with pytest.raises(ValueError, match="parking state"):
        _provisioner(parking="tepid")


def test_a_growing_pool_wakes_a_parked_worker_rather_than_take_one_from_another_pool() -> None:
    before = {"a0": "prefill-attention", "a1": "decode-attention", "a2": "parked-cold", "a3": "parked-warm",
              "f0": "ffn", "f1": "ffn"}
    pools = {"a0": "prefill", "a1": "decode", "f0": "prefill", "f1": "decode"}
    grown = Plan(PoolShape(split=True, attention=2, ffn=1), PoolShape(split=True, attention=1, ffn=1), None, 1,
                 100.0, True)
    got, pool_of = assign(grown, ["a0", "a1", "a2", "a3"], ["f0", "f1"], before, previous_pool=pools)  # type: ignore[arg-type]
    assert got == {"a0": "prefill-attention", "a3": "prefill-attention", "a1": "decode-attention",
                   "a2": "parked-warm", "f0": "ffn", "f1": "ffn"}  # the warm one woke, the decode worker stayed
    assert pool_of["f1"] == "decode" and pool_of["a3"] == "prefill"


def test_assignments_move_as_few_workers_as_they_can() -> None:
    shape = PoolShape(split=True, attention=2, ffn=1)
    plan = Plan(None, None, shape, 3, 100.0, True)
    previous = {"a0": "parked-warm", "a1": "mixed-attention", "a2": "mixed-attention", "f0": "parked-warm",
                "f1": "ffn"}
    got, pool_of = assign(plan, ["a0", "a1", "a2"], ["f0", "f1"], previous)  # type: ignore[arg-type]
    assert got == {"a1": "mixed-attention", "a2": "mixed-attention", "a0": "parked-warm", "f1": "ffn",
                   "f0": "parked-warm"}
    assert pool_of["a1"] == "mixed" and pool_of["a0"] == ""


def test_the_operators_floor_holds() -> None:
    pv = Provisioner(window_s=60.0, ttft_slo_ms=400, tpot_slo_ms=120, link_bytes_s=400e9, min_attention=2,
                     min_ffn=2)
    d = pv.plan(0.0, cached_predictor(A800, QWEN), RULE, ["a0", "a1", "a2"], ["f0", "f1"])
    assert d.plan.mixed is not None and (d.plan.mixed.attention, d.plan.mixed.ffn) == (2, 2)
    assert sum(a.startswith("parked") for a in d.assignments.values()) == 1
    with pytest.raises(ValueError, match="at least one attention and one FFN"):
        Provisioner(window_s=60.0, ttft_slo_ms=400, tpot_slo_ms=120, link_bytes_s=400e9, min_ffn=0)
    with pytest.raises(ValueError, match="provision_window_s"):
        Provisioner(window_s=0.0, ttft_slo_ms=400, tpot_slo_ms=120, link_bytes_s=400e9)
    assert WindowLoad(1.0, 1.0, 1.0).p90_prompt == 0.0


def test_the_scheduler_parks_at_low_load_and_wakes_under_a_burst(nats_url: str) -> None:
    async def main() -> None:
        a0 = ProfiledAttention(None, "a0", kv_total_blocks=20000)  # type: ignore[arg-type]
        async with live(nats_url, a0, provision_window_s=1.0, freq_window_s=0.5) as lv:
            roles: dict[str, list[RoleAssignment]] = {}
            plans: list[PlanTelemetry] = []

            async def on_role(msg: Msg) -> None:
                r = decode(RoleAssignment, msg.data)
                roles.setdefault(r.worker_id, []).append(r)

            async def on_plan(msg: Msg) -> None:
                plans.append(decode(PlanTelemetry, msg.data))

            await lv.nc.subscribe(subjects.role("*"), cb=on_role)
            await lv.nc.subscribe(subjects.TELEMETRY_PLAN, cb=on_plan)
            others = [ProfiledAttention(lv.nc, f"a{i}", kv_total_blocks=20000) for i in (1, 2, 3)]
            for w in others:
                await w.start()
            await lv.ffn("f0")
            await lv.ffn("f1")
            reg = lv.sched.registry.workers

            def parked() -> set[str]:
                return {w for w, x in reg.items() if x.parked}

            # quiet: one attention and one FFN worker serve, the rest park warm at the lowest clock
            await wait_for(lambda: len(parked()) == 4, 10)
            serving_a = [w for w, x in reg.items() if x.role == "attention" and not x.parked]
            await wait_for(lambda: bool(plans))
            assert len(serving_a) == 1 and plans[-1].kind == "mixed"
            await wait_for(lambda: all(roles.get(w) and roles[w][-1].assignment == "parked-warm" for w in parked()))
            lowest = {"prefill": A800_CLOCKS[0], "decode": A800_CLOCKS[0]}
            await wait_for(lambda: all(lv.commands.get(w) and lv.commands[w][-1].clocks_mhz == lowest
                                       for w in parked()), 5)
            # new requests go only to serving workers
            quiet = [await lv.submit(f"q{i}", 50, 4) for i in range(3)]
            assert {lv.sched.requests[f"q{i}"].worker_id for i in range(3) if f"q{i}" in lv.sched.requests} <= set(
                serving_a)
            await asyncio.wait_for(asyncio.gather(*(d.wait() for d in quiet)), 10)
            # a burst of long decodes: the next plan wakes parked workers (of the role it grows), at their clocks again
            was_parked = parked()
            burst = [await lv.submit(f"b{i}", 200, 400) for i in range(40)]
            try:
                await wait_for(lambda: bool(was_parked - parked()), 10)
            except AssertionError:
                raise AssertionError([(p.plan_id, p.load_rps, p.mean_output, p.pools) for p in plans]) from None
            woken = sorted(was_parked - parked())
            serving = {"attention": "mixed-attention", "ffn": "ffn"}
            await wait_for(lambda: all(roles[w][-1].assignment == serving[reg[w].role] for w in woken))
            await wait_for(lambda: all(lv.commands[w][-1].clocks_mhz != lowest for w in woken), 5)
            await asyncio.wait_for(asyncio.gather(*(d.wait() for d in burst)), 60)
            # quiet again: parked again, and every change was telemetry
            start = time.monotonic()
            await wait_for(lambda: len(parked()) == 4 and time.monotonic() - start > 1.0, 15)
            assert any(set(p.changed) & set(woken) for p in plans)
            assert all(p.assignments.keys() == {"a0", "a1", "a2", "a3", "f0", "f1"} for p in plans[-1:])
            tel = lv.sched.telemetry()
            assert tel.plan_id >= 3 and sum(a == "parked-warm" for a in tel.assignments.values()) == 4
            for w in others:
                w.stop_heartbeat()
    asyncio.run(main())


def test_provisioning_off_keeps_every_worker_serving(nats_url: str) -> None:
    async def main() -> None:
        a0 = ProfiledAttention(None, "a0", kv_total_blocks=20000)  # type: ignore[arg-type]
        async with live(nats_url, a0, provisioning="off", provision_window_s=0.2) as lv:
            a1 = ProfiledAttention(lv.nc, "a1", kv_total_blocks=20000)
            await a1.start()
            await lv.ffn("f0")
            await lv.ffn("f1")
            assert lv.sched.provisioning is None
            await asyncio.sleep(0)  # nothing to wait for: no loop was started
            assert all(w.assignment is None and not w.parked for w in lv.sched.registry.workers.values())
            done = [await lv.submit(f"r{i}", 20, 4) for i in range(6)]
            await asyncio.wait_for(asyncio.gather(*(d.wait() for d in done)), 10)
            a1.stop_heartbeat()
    asyncio.run(main())


def test_the_live_headroom_follows_the_ttft_of_the_last_window() -> None:
    pv = _provisioner(window_s=10.0)
    pred = cached_predictor(A800, QWEN)
    for i in range(10):
        pv.first_token(100.0 + i, 900.0)  # every first token over the 400 ms SLO
    pv.plan(110.0, pred, RULE, ["a0"], ["f0"])
    assert pv.headroom_rule.headroom == pytest.approx(1.3 * 1.15)
    assert pv.p90_ttft_ms(200.0) is None  # the window passed: nothing to learn from
    pv.plan(200.0, pred, RULE, ["a0"], ["f0"])
    assert pv.headroom_rule.headroom == pytest.approx(1.3 * 1.15)


@dataclass
class HandingAttention(ProfiledAttention):
    """A fake A800 attention worker with a KV seam: it answers every `KVHandoff` (as a prefill worker whose
    move arrived) and counts the first passes that name an arrived KV (as a decode worker)."""

    handoffs: list[KVHandoff] = field(default_factory=list)

    async def start(self) -> None:
        await self.nc.subscribe(subjects.attn_mb(self.worker_id), cb=self._on_mb)
        await self.nc.subscribe(subjects.attn_kv(self.worker_id), cb=self._on_kv)
        reg = Register(worker_id=self.worker_id, role="attention", model_id="test-model", n_layers=2,
                       kv_total_blocks=self.kv_total_blocks, block_size=self.block_size, max_seq_len=4096,
                       gpu_backend="emulated", gpu_name=self.gpu_name, gpu_profile=self.gpu_profile,
                       supported_clocks_mhz=self.clocks, kv_address=f"gloo://fake:{len(self.worker_id)}")
        assert decode(RegisterReply, (await self.nc.request(subjects.CONTROL_REGISTER, encode(reg), 5)).data).ok
        self._hb = asyncio.create_task(heartbeat(self.nc, self.worker_id, "attention", self.kv_total_blocks))

    async def _on_kv(self, msg: Msg) -> None:
        req = decode(KVHandoff, msg.data)
        self.handoffs.append(req)
        await msg.respond(encode(KVHandoffReply(handoff_id=req.handoff_id, ok=True, nbytes=1000 * req.num_tokens,
                                                seconds=0.001)))

    def adopted(self) -> list[SeqWork]:
        return [s for d in self.descriptors for s in d.seqs if s.kv_from is not None]


def test_pd_pools_park_at_low_load_wake_under_a_burst_and_hand_every_sequence_over(nats_url: str) -> None:
    """4 attention-capable and 2 FFN workers (fake A800s, the Qwen3-32B shape: the plans are the
    predictors'), `provision_kinds` pd, a load that rises and falls: quiet, the smallest P/D plan serves
    (a prefill and a decode attention worker, an FFN worker each) and the other two park; a burst wakes
    parked attention workers into the pools; quiet again, they park again. Every request is prefilled on
    a prefill worker, moved with a `KVHandoff` and decoded on a decode worker whose first pass names the
    arrived KV, and finishes; each change is `PlanTelemetry`. (The tokens of a real handoff are the
    engine's: tests/test_mesh_pd.py.)"""
    async def main() -> None:
        a0 = HandingAttention(None, "a0", kv_total_blocks=20000)  # type: ignore[arg-type]
        async with live(nats_url, a0, provision_window_s=1.0, freq_window_s=0.5, provision_kinds="pd") as lv:
            plans: list[PlanTelemetry] = []

            async def on_plan(msg: Msg) -> None:
                plans.append(decode(PlanTelemetry, msg.data))

            await lv.nc.subscribe(subjects.TELEMETRY_PLAN, cb=on_plan)
            others = [HandingAttention(lv.nc, f"a{i}", kv_total_blocks=20000) for i in (1, 2, 3)]
            for w in others:
                await w.start()
            workers = [a0, *others]
            await lv.ffn("f0")
            await lv.ffn("f1")
            reg = lv.sched.registry.workers

            def serving(role: str) -> list[str]:
                return sorted(w for w, x in reg.items() if x.assignment == role)

            await wait_for(lambda: bool(plans) and plans[-1].kind == "pd" and len(serving("parked-warm")) == 2, 10)
            assert len(serving("prefill-attention")) == 1 and len(serving("decode-attention")) == 1
            weighed = plans[-1].weighed  # the kinds the plan was chosen from, and their predicted power
            assert set(weighed) == {"pd"} and weighed["pd"].predicted_power_w == plans[-1].predicted_power_w
            assert {reg[w].pool for w in serving("ffn")} == {"prefill", "decode"}
            quiet = [await lv.submit(f"q{i}", 50, 6) for i in range(3)]
            await asyncio.wait_for(asyncio.gather(*(d.wait() for d in quiet)), 20)
            burst = [await lv.submit(f"b{i}", 200, 400) for i in range(40)]
            try:
                await wait_for(lambda: len(serving("parked-warm")) < 2, 10)
            except AssertionError:
                raise AssertionError([(p.plan_id, p.load_rps, p.pools) for p in plans]) from None
            await asyncio.wait_for(asyncio.gather(*(d.wait() for d in burst)), 90)
            start = time.monotonic()
            await wait_for(lambda: len(serving("parked-warm")) == 2 and time.monotonic() - start > 1.0, 15)
            moved = {req.seq_id for w in workers for req in w.handoffs}
            adopted = {s.seq_id for w in workers for s in w.adopted()}
            asked = {f"q{i}" for i in range(3)} | {f"b{i}" for i in range(40)}
            assert moved == asked and adopted == asked  # every one prefilled on one worker, decoded on another
            # (a sequence moves again only when its decode worker became a prefill worker, which `assign` avoids)
            assert lv.sched.dispatch.handoffs.moved == len(asked) and lv.sched.dispatch.handoffs.failed == 0
            assert all(s.start_pos in (50, 200) and s.sampling is not None for w in workers for s in w.adopted())
            assert any(p.changed for p in plans[1:]) and {p.kind for p in plans} == {"pd"}
            for w in others:
                w.stop_heartbeat()
    asyncio.run(main())

"""The live power correction (services/scheduler/power_books.py): the simulator's `PowerCorrection` fed by the
mesh's own energy counters, so that the live planner ranks plan kinds as the simulator's AFlex does."""

from __future__ import annotations

import pytest

from loadgen.sim.models import get_model
from services.scheduler.fleet_plan import Provisioner
from services.scheduler.power_books import MeshEnergy
from services.scheduler.registry import Registry
from shared.gpu.emulated import load_profile
from shared.messages import Heartbeat
from shared.perf import cached_predictor
from shared.policy import SHARED_CLOCK_OBJECTIVE, ClockRule
from shared.policy.footprint import plan_power_w

LLAMA = get_model("llama-3-8b")
A800 = load_profile("a800")
RULE = ClockRule(objective=SHARED_CLOCK_OBJECTIVE)
KINDS = ("mixed", "colocated")


def test_the_mesh_energy_sums_each_workers_counter_by_increments() -> None:
    mesh = MeshEnergy()
    mesh.report("a0", 100.0)  # a first reading: the baseline, nothing drawn yet
    mesh.report("f0", 50.0)
    mesh.report("a0", 130.0)
    mesh.report("f0", None)  # not reported: nothing added, the last reading kept
    mesh.report("f0", 60.0)
    assert mesh.total_j == pytest.approx(40.0)
    mesh.report("a0", 5.0)  # went back: restarted, its counter from zero
    assert mesh.total_j == pytest.approx(45.0)


def test_heartbeats_carry_each_workers_energy_counter() -> None:
    reg = Registry()
    worker, _ = reg.heartbeat(Heartbeat(worker_id="f0", role="ffn", ts=0.0, gpu_energy_j=12.5), 0.0)
    assert worker.gpu_energy_j == 12.5
    worker, _ = reg.heartbeat(Heartbeat(worker_id="f0", role="ffn", ts=1.0), 1.0)
    assert worker.gpu_energy_j is None


def test_a_kinds_power_is_corrected_by_what_its_plans_drew_on_the_mesh() -> None:
    pv = Provisioner(window_s=10.0, ttft_slo_ms=400, tpot_slo_ms=120, link_bytes_s=400e9, parking="warm",
                     kinds=KINDS)
    pred = cached_predictor(A800, LLAMA)
    workers = (["a0", "a1"], ["f0"])

    def arrivals(t0: float, t1: float) -> None:
        for i in range(int(t0 * 2), int(t1 * 2)):  # 2 req/s
            pv.loads.admitted(f"r{i}", i / 2, 600, 200)

    arrivals(0.0, 10.0)
    first = pv.plan(10.0, pred, RULE, *workers, colocate_ids=["a0", "a1"])
    assert first.power_factor == {"mixed": 1.0, "colocated": 1.0}  # nothing observed yet
    stretch = pv.power.stretch
    assert stretch is not None and stretch.plan == first.plan and stretch.since_mono == 10.0
    # 10 s later: shorter than a kind's first observation must be (30 s), so the stretch goes on
    arrivals(10.0, 20.0)
    pv.power.energy.report("mesh", 0.0)
    pv.power.energy.report("mesh", 1000.0)
    second = pv.plan(20.0, pred, RULE, *workers, colocate_ids=["a0", "a1"])
    assert pv.power.correction.sums == {} and second.power_factor == {"mixed": 1.0, "colocated": 1.0}
    assert second.plan == first.plan and pv.power.stretch is stretch  # the same plan: the same stretch
    # 40 s in force: what it drew against what the pool models price it at for the load that came
    arrivals(20.0, 50.0)
    pv.power.energy.report("mesh", 1000.0 + 5000.0)
    seen = pv.observe(50.0)
    assert seen.stretch_load is not None
    want_w = plan_power_w(pred, first.plan, seen.stretch_load, stretch.spec, RULE)
    assert want_w is not None
    third = pv.plan(50.0, pred, RULE, *workers, observed=seen, colocate_ids=["a0", "a1"])
    kind = first.plan.kind
    assert pv.power.correction.sums[kind] == pytest.approx((6000.0, want_w * 40.0))
    factor = min(4.0, max(0.25, 6000.0 / (want_w * 40.0)))
    assert third.power_factor == pytest.approx({k: factor for k in KINDS})  # the unobserved kind: the mean
    assert pv.power.stretch is not None and pv.power.stretch.since_mono == 50.0

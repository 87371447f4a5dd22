"""Each plan kind's predicted power, corrected by what its plans drew (shared/policy/power_correction.py)."""

from __future__ import annotations

import pytest

from shared.policy.power_correction import PowerCorrection


def test_a_kind_learns_the_ratio_of_discounted_energies() -> None:
    c = PowerCorrection(window_s=300.0, memory=0.5, min_span_s=30.0)
    assert c.factors(("pd", "colocated")) == {"pd": 1.0, "colocated": 1.0}
    assert not c.observe("colocated", 1000.0, 0.7 * 1000.0 * 20, 20.0)  # too short to be its first look
    assert c.factor("colocated") == 1.0
    assert c.observe("colocated", 1000.0, 0.7 * 1000.0 * 300, 300.0)
    assert c.factor("colocated") == pytest.approx(0.7)  # the first observation sets it outright
    assert c.factor("pd") == pytest.approx(0.7)  # a kind never run: the error the observed kinds share
    assert c.observe("colocated", 500.0, 0.9 * 500.0 * 20, 20.0)  # once known, short stretches count, a little
    keep = 0.5 ** (20 / 300)
    expected = (keep * 0.7 * 300_000 + 9_000) / (keep * 300_000 + 10_000)
    assert c.factor("colocated") == pytest.approx(expected)
    for _ in range(10):  # a window later an observation weighs half: the factor follows the kind's recent runs
        c.observe("colocated", 1000.0, 0.5 * 1000.0 * 300, 300.0)
    assert c.factor("colocated") == pytest.approx(0.5, abs=1e-3)
    c.observe("pd", 1000.0, 1.1 * 1000.0 * 300, 300.0)
    assert c.factors(("pd", "colocated", "mixed")) == pytest.approx({"pd": 1.1, "colocated": 0.5, "mixed": 0.8},
                                                                   abs=1e-3)


def test_a_kind_that_missed_the_slo_gains_nothing_from_its_factor_until_it_meets_it() -> None:
    c = PowerCorrection()
    c.observe("pd", 1000.0, 1.1 * 300_000, 300.0)
    c.observe("colocated", 1000.0, 0.6 * 300_000, 300.0, slo_met=False)  # cheap, but late
    assert c.factors(("pd", "colocated", "mixed")) == pytest.approx({"pd": 1.1, "colocated": 1.1, "mixed": 0.85})
    c.observe("colocated", 1000.0, 0.6 * 300_000, 300.0)
    assert c.factor("colocated") == pytest.approx(0.6)
    c.observe("pd", 1000.0, 0.5 * 300_000, 300.0, slo_met=False)  # its own factor, when the highest, holds
    assert c.factor("pd") == pytest.approx((0.5 * 1.1 + 0.5) / 1.5) and c.factor("pd") > c.factor("colocated")


def test_a_kind_that_missed_its_slo_at_a_load_is_barred_there_and_above_unless_every_kind_did() -> None:
    c = PowerCorrection()
    c.judged("colocated", True, 12.0)
    assert c.barred(("colocated", "pd-colocated"), 20.0) == frozenset()  # met: nothing barred
    c.judged("colocated", False, 11.0)
    c.judged("colocated", False, 15.0)  # the least load it missed at is kept
    assert c.failed_at_rps == {"colocated": 11.0}
    assert c.barred(("colocated", "pd-colocated"), 11.0) == {"colocated"}
    assert c.barred(("colocated", "pd-colocated"), 10.9) == frozenset()  # a lighter load: it may come back
    assert c.barred(("pd-colocated",), 20.0) == frozenset()  # not weighed: nothing to bar
    c.judged("pd-colocated", False, 14.0)
    assert c.barred(("colocated", "pd-colocated"), 12.0) == {"colocated"}
    assert c.barred(("colocated", "pd-colocated"), 14.0) == frozenset()  # every kind missed here: none barred


def test_a_barred_kind_gives_way_to_a_kind_that_holds_the_load_before_the_headroom() -> None:
    from loadgen.sim.models import get_model
    from shared.gpu.emulated import load_profile
    from shared.perf import cached_predictor
    from shared.policy import ClockRule, ClusterSpec, WindowLoad
    from shared.policy.footprint import candidate_plans, elastic_plan

    model = get_model("qwen3-32b")
    pred = cached_predictor(load_profile("a800"), model)
    spec = ClusterSpec.for_model(model, 16, ttft_slo_s=0.4, tpot_slo_s=0.12, link_bytes_s=400e9, parked_power_w=34.0)
    load = WindowLoad(2.0, 1000.0, 200.0, 3000.0)
    kinds = ("colocated", "pd-colocated")
    plans = candidate_plans(pred, load, spec, ClockRule(), 1.3, kinds)
    first = elastic_plan(pred, load, spec, ClockRule(), kinds=kinds)
    other = next(k for k in kinds if k != first.kind)
    assert plans[other].feasible
    assert elastic_plan(pred, load, spec, ClockRule(), kinds=kinds, current_kind=first.kind,
                        barred={first.kind}).kind == other  # kept before, for the switch's cost; not now
    # where no other kind holds the load even before the headroom, the barred kind is weighed as usual
    alone = elastic_plan(pred, load, spec, ClockRule(), kinds=(first.kind, "pd"), barred={first.kind})
    assert plans[first.kind].feasible and (alone.kind == first.kind) == (
        candidate_plans(pred, load, spec, ClockRule(), 1.3, ("pd",))["pd"].predicted_power_w >= 1.3e9)


def test_the_factor_is_bounded_and_nothing_is_learned_from_no_prediction() -> None:
    c = PowerCorrection(bounds=(0.25, 4.0))
    assert not c.observe("pd", 0.0, 1e6, 300.0)
    c.observe("pd", 100.0, 100.0 * 300 * 10, 300.0)
    assert c.factor("pd") == 4.0
    c.observe("colocated", 100.0, 0.0, 300.0)
    assert c.factor("colocated") == 0.25
    assert PowerCorrection().factor("pd") == 1.0  # nothing observed: the model's own figure


def test_the_planner_ranks_kinds_by_corrected_power_and_returns_the_models_figure() -> None:
    from loadgen.sim.models import get_model
    from shared.gpu.emulated import load_profile
    from shared.perf import cached_predictor
    from shared.policy import ClockRule, ClusterSpec, WindowLoad
    from shared.policy.footprint import AFLEX_KINDS, candidate_plans, elastic_plan, plan_power_w

    args = get_model("mixtral-8x7b")
    pred = cached_predictor(load_profile("a800"), args)
    spec = ClusterSpec.for_model(args, 16, ttft_slo_s=0.4, tpot_slo_s=0.12, link_bytes_s=400e9, parked_power_w=0.0)
    load = WindowLoad(10.0, 1000, 250, 2500)
    plans = candidate_plans(pred, load, spec, ClockRule(), kinds=AFLEX_KINDS)
    first = elastic_plan(pred, load, spec, ClockRule(), kinds=AFLEX_KINDS)
    other = next(k for k in plans if k != first.kind)
    ratio = plans[first.kind].predicted_power_w / plans[other].predicted_power_w
    assert ratio < 1
    # the other kind seen to draw less than its prediction, by more than the model's margin: it is ranked first
    seen = {first.kind: 1.0, other: 0.9 * ratio}
    plan = elastic_plan(pred, load, spec, ClockRule(), kinds=AFLEX_KINDS, power_factor=seen)
    assert plan.kind == other and plan.predicted_power_w == plans[other].predicted_power_w
    # a switch must still pay `switch_saving` of the held kind's corrected power
    held = elastic_plan(pred, load, spec, ClockRule(), current_kind=first.kind, switch_saving=0.2, kinds=AFLEX_KINDS,
                        power_factor=seen)
    assert held.kind == first.kind
    assert elastic_plan(pred, load, spec, ClockRule(), kinds=AFLEX_KINDS, power_factor={}).kind == first.kind
    # a plan priced again at the load it was planned for (× the headroom) is its own prediction; at a load
    # it cannot hold, the model has no figure
    planned = WindowLoad(10.0 * 1.3, 1000, 250, 2500)
    for kind, p in plans.items():
        assert plan_power_w(pred, p, planned, spec, ClockRule()) == pytest.approx(p.predicted_power_w, rel=1e-9), kind
        assert plan_power_w(pred, p, WindowLoad(1000.0, 1000, 250, 2500), spec, ClockRule()) is None, kind


def test_the_simulators_aflex_corrects_its_kinds_and_single_kind_policies_do_not() -> None:
    from loadgen.sim.arrivals import synthetic
    from loadgen.sim.engine import SimConfig, Simulation
    from loadgen.sim.models import get_model
    from loadgen.sim.policies import policy_spec
    from shared.gpu.emulated import load_profile
    from shared.perf import cached_predictor
    from shared.policy.footprint import AFLEX_KINDS

    prof, model = load_profile("a800"), get_model("mixtral-8x7b")
    arr = synthetic(1.0, 700.0, 1, prompt_mean=500, output_mean=50)
    pred = cached_predictor(prof, model)
    for name in ("aflex-pd-only", "aflex-colocated-only", "dynamollm"):
        assert Simulation(prof, model, arr, policy_spec(name), SimConfig(gpus=8), pred).correction is None, name
    for accounting in ("cluster", "active"):
        sim = Simulation(prof, model, arr, policy_spec("aflex"), SimConfig(gpus=8, accounting=accounting), pred)
        res = sim.run()
        assert sim.correction is not None and sim.correction.sums, accounting  # the plans in force were observed
        assert set(res["power_factor"]) == set(AFLEX_KINDS)  # in the JSON
        for kind, (obs_j, pred_j) in sim.correction.sums.items():
            assert obs_j > 0 and pred_j > 0 and 0.25 < sim.correction.factor(kind) < 4.0, (accounting, kind)

"""AFlex's elastic footprint (shared/policy/footprint.py): every plan kind weighed, the cheapest kept.

The small cases are checked exhaustively: every shape of every kind that fits the cluster is priced with
the provisioner's own pool models, and the planner's answer must be the least of them all.
"""

from __future__ import annotations

import pytest

from loadgen.sim.models import attention_weight_bytes, ffn_weight_bytes, get_model, kv_bytes_per_token
from shared.gpu.emulated import load_profile
from shared.kinds import PLAN_KINDS
from shared.perf import Predictor, cached_predictor
from shared.policy import ClockRule, ClusterSpec, PoolShape, WindowLoad
from shared.policy.colocated import instance_tps
from shared.policy.footprint import (
    AFLEX_KINDS,
    REPLICA_TIE_SHARE,
    candidate_plans,
    elastic_plan,
    smallest_pd_gpus,
)
from shared.policy.pool_sizing import INFEASIBLE, decode_power, mixed_power, prefill_power

RULE = ClockRule()  # plans are priced on whole-iteration energy whatever the clock objective


def _spec(model: str, gpus: int, pred: Predictor) -> ClusterSpec:
    args = get_model(model)
    return ClusterSpec(gpus, 80e9, attention_weight_bytes(args), ffn_weight_bytes(args), kv_bytes_per_token(args),
                       400e9, 0.34, 0.1, pred.profile.idle_power_w)  # parked cold


def _exhaustive(pred: Predictor, load: WindowLoad, spec: ClusterSpec, headroom: float) -> dict[str, float]:
    """The least predicted power of each kind over every shape that fits, priced as the provisioner prices."""
    hl = WindowLoad(load.rate_rps * headroom, load.mean_prompt, load.mean_output, load.p90_prompt)
    n, fmin, parked = spec.gpus, spec.ffn_min, spec.parked_power_w
    split = [(a, f) for f in range(fmin, n) for a in range(1, n - f + 1)]
    best = {"mixed": min(mixed_power(pred, PoolShape(True, a, f, link_bytes_s=spec.link_bytes_s), hl, spec, RULE)
                         + (n - a - f) * parked for a, f in split)}
    colocated = [PoolShape(False, replicas=r, tp=tp, link_bytes_s=spec.link_bytes_s)
                 for tp in instance_tps(spec, n) for r in range(1, n // tp + 1)]
    if colocated:
        best["colocated"] = min(mixed_power(pred, s, hl, spec, RULE) + (n - s.gpus) * parked for s in colocated)
    if n >= smallest_pd_gpus(spec):
        pools = [PoolShape(True, a, f, link_bytes_s=spec.link_bytes_s, attention_tp=tp) for a, f in split
                 for tp in (1, 2, 4, 8) if a % tp == 0 and tp <= pred.args.n_kv_heads]
        pre = {p: prefill_power(pred, p, hl, spec, RULE) for p in pools}
        dec = {p: decode_power(pred, p, hl, spec, RULE) for p in pools if p.attention_tp == 1}
        best["pd"] = min(pp + dp + (n - p.gpus - d.gpus) * parked for p, pp in pre.items() for d, dp in dec.items()
                         if p.gpus + d.gpus <= n)
    if len(colocated) > 1:  # two replicas at least: a prefill pool and a decode pool of them
        pre_i = {s: prefill_power(pred, s, hl, spec, RULE) for s in colocated}
        dec_i = {s: decode_power(pred, s, hl, spec, RULE) for s in colocated}
        best["pd-colocated"] = min(pp + dp + (n - p.gpus - d.gpus) * parked for p, pp in pre_i.items()
                                   for d, dp in dec_i.items() if p.gpus + d.gpus <= n)
    return best


@pytest.fixture(scope="module")
def mixtral() -> Predictor:
    return cached_predictor(load_profile("a800"), get_model("mixtral-8x7b"))


def test_each_kind_is_the_least_of_its_shapes_checked_exhaustively(mixtral: Predictor) -> None:
    spec = _spec("mixtral-8x7b", 7, mixtral)
    load = WindowLoad(0.3, 600, 150, 1500)
    plans = candidate_plans(mixtral, load, spec, RULE, headroom=1.3)
    assert set(plans) == set(PLAN_KINDS)
    exhaustive = _exhaustive(mixtral, load, spec, 1.3)
    for kind, plan in plans.items():
        assert plan.kind == kind and plan.predicted_power_w == pytest.approx(exhaustive[kind], rel=1e-9), kind
        pd = kind in ("pd", "pd-colocated")
        assert plan.gpus + plan.parked == spec.gpus and set(plan.pools()) == ({"prefill", "decode"} if pd else {kind})


def test_a_shared_pool_wins_where_the_split_cannot_shrink(mixtral: Predictor) -> None:
    """Mixtral's experts need two GPUs, so a P/D split needs six; at a trickle one pool is cheaper, and the
    planner's answer is the least predicted power of every shape of every kind it weighs (P/D replicas give
    way to one pool of them within `REPLICA_TIE_SHARE`)."""
    spec = _spec("mixtral-8x7b", 7, mixtral)
    load = WindowLoad(0.3, 600, 150, 1500)
    exhaustive = _exhaustive(mixtral, load, spec, 1.3)
    for kinds in (PLAN_KINDS, AFLEX_KINDS):
        plan = elastic_plan(mixtral, load, spec, RULE, kinds=kinds)
        least = min(exhaustive[k] for k in kinds)
        assert plan.kind != "pd" and plan.feasible, kinds
        assert plan.predicted_power_w == pytest.approx(exhaustive[plan.kind], rel=1e-9)
        assert plan.predicted_power_w == pytest.approx(least, rel=1e-9) or (
            plan.kind == "colocated" and plan.predicted_power_w <= least * (1 + REPLICA_TIE_SHARE))
        assert least < exhaustive["pd"] < INFEASIBLE
    colocated = elastic_plan(mixtral, load, spec, RULE, kinds=AFLEX_KINDS)
    assert colocated.kind == "colocated" and colocated.mixed is not None and colocated.mixed.gpus == 2  # one TP2


def test_the_order_of_the_kinds_weighed_does_not_change_the_plan(mixtral: Predictor) -> None:
    """The live scheduler once listed the kinds mixed first: the candidates are built and ranked in one order
    whatever order they are asked in, so any order gives the same plan."""
    for gpus, load in ((7, WindowLoad(0.3, 600, 150, 1500)), (16, WindowLoad(10.0, 1000, 250, 2500))):
        spec = _spec("mixtral-8x7b", gpus, mixtral)
        want = elastic_plan(mixtral, load, spec, RULE, kinds=PLAN_KINDS)
        for kinds in (("mixed", "pd", "colocated"), tuple(reversed(PLAN_KINDS))):
            assert elastic_plan(mixtral, load, spec, RULE, kinds=kinds) == want, kinds


def test_grown_split_pools_are_kept_and_a_kind_change_must_pay(mixtral: Predictor) -> None:
    spec = _spec("mixtral-8x7b", 16, mixtral)
    busy = WindowLoad(15.0, 1000, 250, 2500)
    plan = elastic_plan(mixtral, busy, spec, RULE, kinds=AFLEX_KINDS)
    busy_plans = candidate_plans(mixtral, busy, spec, RULE, kinds=AFLEX_KINDS)
    assert plan.kind == "pd" and plan.gpus > smallest_pd_gpus(spec)
    assert plan.predicted_power_w == min(p.predicted_power_w for p in busy_plans.values())
    quiet = WindowLoad(0.3, 600, 150, 1500)
    plans = candidate_plans(mixtral, quiet, spec, RULE)
    cheapest = min(plans.values(), key=lambda p: p.predicted_power_w)
    saving = 1 - cheapest.predicted_power_w / plans["pd"].predicted_power_w
    assert cheapest.kind != "pd" and saving > 0
    # held at its kind unless the other saves more than switch_saving of its power
    assert elastic_plan(mixtral, quiet, spec, RULE, current_kind="pd", switch_saving=saving + 0.01).kind == "pd"
    assert elastic_plan(mixtral, quiet, spec, RULE, current_kind="pd", switch_saving=saving / 2).kind == cheapest.kind
    with pytest.raises(ValueError, match="hold no plan"):
        elastic_plan(mixtral, quiet, _spec("mixtral-8x7b", 1, mixtral), RULE)


def test_a_split_that_cannot_hold_the_load_gives_way_to_a_kind_that_can() -> None:
    """Two 8-GPU nodes keep split pools inside a node, where Coding's 5,000-token prompts cannot meet the
    TTFT budget; TP8 replicas can. The infeasible split was kept before (issue 38): P90 TTFT 22 s."""
    qwen = cached_predictor(load_profile("a800"), get_model("qwen3-32b"))
    spec = ClusterSpec.for_model(get_model("qwen3-32b"), 16, ttft_slo_s=0.4, tpot_slo_s=0.12, link_bytes_s=400e9,
                                 parked_power_w=34.0, node_gpus=8, inter_node_bytes_s=25e9)
    load = WindowLoad(3.0, 2000.0, 30.0, 5000.0)
    plans = candidate_plans(qwen, load, spec, RULE, 1.3, AFLEX_KINDS)
    assert not plans["pd"].feasible and plans["colocated"].feasible
    plan = elastic_plan(qwen, load, spec, RULE, kinds=AFLEX_KINDS, current_kind="pd")
    assert plan.kind in ("colocated", "pd-colocated") and plan.feasible  # TP8 replicas, in one pool or P/D pools
    least = min(p.predicted_power_w for p in plans.values() if p.feasible)
    assert plan.predicted_power_w == least or plan.predicted_power_w <= least * (1 + REPLICA_TIE_SHARE)
    alone = elastic_plan(qwen, load, spec, RULE, kinds=("pd",))  # no kind holds it: the split is kept
    assert alone.kind == "pd" and not alone.feasible
    # a load no kind holds: the plan that overloads its pools least, whatever its kind
    surge = WindowLoad(40.0, 2000.0, 300.0, 5000.0)
    over = candidate_plans(qwen, surge, spec, RULE, 1.3, AFLEX_KINDS)
    assert not any(p.feasible for p in over.values())
    least = elastic_plan(qwen, surge, spec, RULE, kinds=AFLEX_KINDS, current_kind="pd")
    assert least.predicted_power_w == min(p.predicted_power_w for p in over.values())
    assert least.kind != "pd"  # the split inside a node overloads most (code-Qwen3's 6.4 s P90 TTFT)


def test_a_kind_no_shape_of_which_fits_is_left_out_not_raised() -> None:
    """Qwen3-235B-A22B on 16 GPUs: its 128 experts form FFN groups of 8, so split P/D pools (two FFN groups
    beside attention) do not fit, while one mixed pool does; the planner weighs the kinds that fit."""
    model = get_model("qwen3-235b-a22b")
    pred = cached_predictor(load_profile("h100"), model)
    spec = ClusterSpec.for_model(model, 16, ttft_slo_s=0.4, tpot_slo_s=0.12, link_bytes_s=400e9, parked_power_w=34.0)
    plans = candidate_plans(pred, WindowLoad(1.0, 1000.0, 200.0, 3000.0), spec, RULE, 1.3, PLAN_KINDS)
    assert "pd" not in plans and "mixed" in plans
    assert elastic_plan(pred, WindowLoad(1.0, 1000.0, 200.0, 3000.0), spec, RULE).kind in plans


def test_p_d_replicas_give_way_to_one_pool_of_them_inside_the_models_error(mixtral: Predictor) -> None:
    """The two replica kinds, priced by the same instance models: P/D pools are taken only where they save
    more than `REPLICA_TIE_SHARE` (code-Mixtral under fixed-pool ran them for the hour at a 1.2% predicted
    saving and drew 8% more than one pool)."""
    spec = _spec("mixtral-8x7b", 16, mixtral)
    kinds = ("colocated", "pd-colocated")
    for load in (WindowLoad(r, 1000, 250, 2500) for r in (0.5, 2.0, 5.0, 10.0)):
        plans = candidate_plans(mixtral, load, spec, RULE, 1.3, kinds)
        plan = elastic_plan(mixtral, load, spec, RULE, kinds=kinds)
        pd, one = plans["pd-colocated"], plans["colocated"]
        if pd.feasible and one.feasible:
            want = "pd-colocated" if pd.predicted_power_w * (1 + REPLICA_TIE_SHARE) < one.predicted_power_w \
                else "colocated"
            assert plan.kind == want, (load, pd.predicted_power_w, one.predicted_power_w)

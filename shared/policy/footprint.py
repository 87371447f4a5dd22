"""AFlex's elastic footprint: one planning call weighs every shape a live mesh can serve, keeps the cheapest.

The shapes (`Plan.kind`):
- "pd": a prefill pool and a decode pool, each with attention and FFN GPUs (`pool_sizing.provision`);
- "mixed": one A/F split pool whose attention GPUs run prefill and decode (`pool_sizing.provision_mixed`);
- "colocated": whole-model replicas, both halves on one GPU or TP group, a clock per phase
  (`colocated.provision_colocated`, the search DynamoLLM's planner makes);
- "pd-colocated": a prefill pool and a decode pool of whole-model replicas, each at its own clocks, the
  KV handed from one to the other (`baseline_placement.provision_pd`, BiScale's coarse tier), so AFlex's
  plan space holds every rival's kind.

Why all of them: the split pays its seam hop and the idle power of two GPU roles per pool; a P/D plan
needs at least 2 × (1 + the FFN's GPUs) GPUs, and a prefill pool whose long prompts need attention
TP needs more, so at low load (or under `active` accounting, where a parked GPU costs the planner
nothing) one TP2 or TP4 replica can be cheaper than any split plan. Every candidate is priced by the
same predictors and power model, under the same SLO budgets, and the least predicted power wins.
When a plan cannot hold the load (infeasible), a feasible plan of another kind is taken; when no kind
holds it, the plan that overloads its pools least (its `predicted_power_w` is `INFEASIBLE` times the
overload). The split is not always the largest: on two 8-GPU nodes a split pool past a node runs its
seam and FFN all-reduce over the network, so the planner keeps split pools inside a node (issue 38),
where colocated TP8 replicas on both nodes hold more. On code-Qwen3 at ×1 (the burst load times the
headroom outgrows every kind in most windows), keeping the split there reached P90 TTFT 6.4 s; the
least-overloaded kind, two TP8 replicas, 473 ms at 3% less energy (docs/evaluation.md). On a live mesh
whose workers each hold one half (`ClusterSpec.max_attention` / `max_ffn`), P/D can overflow its FFN
workers alone, one per pool, while one mixed pool shares them and holds the load.
Mixed A/F pools are left out of `AFLEX_KINDS`: the model sized them too large before its idle term
was fixed, and they have not been measured since (docs/evaluation.md). A change
of kind drains pools (requests finish where they are, their GPUs then move), so the current kind is
kept unless another saves more than `switch_saving` of its predicted power. `power_factor` scales each
kind's predicted power in that ranking: the correction from observed energy (`power_correction.py`).
The simulator's AFlex planner calls `elastic_plan`; so does the live scheduler (services/scheduler/fleet_plan.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping
from dataclasses import replace

from shared.kinds import PLAN_KINDS, PlanKind
from shared.perf import Predictor
from shared.policy.baseline_placement import provision_pd, smallest_pd_instances
from shared.policy.colocated import colocated_options, provision_colocated
from shared.policy.operating_point import ClockRule
from shared.policy.pool_sizing import (
    INFEASIBLE,
    ClusterSpec,
    Plan,
    WindowLoad,
    decode_power,
    mixed_power,
    prefill_power,
    provision,
    provision_mixed,
)

# P/D pools of replicas and one pool of them, priced by the same instance models, are a tie this close
# (their error between the two: conv-Qwen3's priced 1.9% apart drew 0.4% apart the other way; code-Mixtral
# under fixed-pool priced 1.2% apart drew 8% apart), and the one pool is taken: no KV handoff, one clock
# pair to settle, nothing the decode pool idles on
REPLICA_TIE_SHARE = 0.03
# what AFlex weighs by default (why not "mixed": docs/evaluation.md); every kind: `shared.kinds.PLAN_KINDS`
AFLEX_KINDS: tuple[PlanKind, ...] = ("pd", "colocated", "pd-colocated")


def candidate_plans(pred: Predictor, load: WindowLoad, spec: ClusterSpec, rule: ClockRule,
                    headroom: float = 1.3, kinds: tuple[str, ...] = PLAN_KINDS) -> dict[str, Plan]:
    """The least-power plan of each kind that fits the cluster (a kind that cannot hold the model is left out:
    e.g. split P/D pools of Qwen3-235B-A22B on 16 GPUs, whose experts form FFN groups of 8, not 7)."""
    searches = {
        "pd": (spec.gpus >= smallest_pd_gpus(spec),
               lambda: provision(pred, load, spec, rule, headroom=headroom, min_pd_gpus=smallest_pd_gpus(spec))),
        "mixed": (spec.gpus >= 1 + spec.ffn_min, lambda: provision_mixed(pred, load, spec, rule, headroom)),
        "colocated": (bool(colocated_options(spec)), lambda: provision_colocated(pred, load, spec, rule, headroom)),
        "pd-colocated": (bool(smallest_pd_instances(spec)), lambda: provision_pd(pred, load, spec, rule, headroom)),
    }
    plans: dict[str, Plan] = {}
    for kind, (fits, search) in searches.items():
        if kind in kinds and fits:
            with contextlib.suppress(ValueError):  # no shape of this kind fits the cluster's groups
                plans[kind] = search()
    return plans


def smallest_pd_gpus(spec: ClusterSpec) -> int:
    """The fewest GPUs a P/D plan takes: two pools of one attention GPU beside the FFN's GPUs."""
    return 2 * (1 + spec.ffn_min)


def elastic_plan(pred: Predictor, load: WindowLoad, spec: ClusterSpec, rule: ClockRule, headroom: float = 1.3,
                 current_kind: str | None = None, switch_saving: float = 0.05,
                 kinds: tuple[str, ...] = PLAN_KINDS, power_factor: Mapping[str, float] | None = None,
                 barred: Collection[str] = ()) -> Plan:
    """The plan with the least predicted power among `candidate_plans` (feasible ones first); the current
    kind's plan is kept unless the best saves more than `switch_saving` of its power. Each kind's power is
    ranked times `power_factor[kind]` (1.0 if absent); the plan returned keeps the model's prediction. A
    `barred` kind (it missed an SLO at this load: `PowerCorrection.barred`) ranks with the infeasible plans."""
    return weigh_kinds(pred, load, spec, rule, headroom, current_kind, switch_saving, kinds, power_factor,
                       barred)[0]


def weigh_kinds(pred: Predictor, load: WindowLoad, spec: ClusterSpec, rule: ClockRule, headroom: float = 1.3,
                current_kind: str | None = None, switch_saving: float = 0.05,
                kinds: tuple[str, ...] = PLAN_KINDS, power_factor: Mapping[str, float] | None = None,
                barred: Collection[str] = ()) -> tuple[Plan, dict[str, Plan]]:
    """`elastic_plan`'s choice and every kind's plan it weighed (what the plan telemetry says it chose from)."""
    plans = candidate_plans(pred, load, spec, rule, headroom, kinds)
    if not plans:
        raise ValueError(f"{spec.gpus} GPUs hold no plan of kinds {', '.join(kinds)}")
    # a barred kind gives way to any other that holds the load before the headroom (its overload, the factor
    # `INFEASIBLE` is multiplied by, under `headroom`); where none does, every kind is weighed as usual
    near = [p for p in plans.values() if p.kind not in barred and p.predicted_power_w < INFEASIBLE * headroom]
    open_plans = near if barred and near else list(plans.values())
    if not any(p.feasible for p in open_plans):  # no kind holds the load: the one it overloads least
        return min(open_plans, key=lambda p: p.predicted_power_w), plans
    factor = power_factor or {}

    def power_w(p: Plan) -> float:
        return p.predicted_power_w * factor.get(p.kind, 1.0)

    best = min(open_plans, key=lambda p: (not p.feasible, power_w(p)))
    one_pool = next((p for p in open_plans if p.kind == "colocated" and p.feasible), None)
    if best.kind == "pd-colocated" and one_pool is not None \
            and power_w(one_pool) <= power_w(best) * (1.0 + REPLICA_TIE_SHARE):
        best = one_pool  # replicas in P/D pools only where the instance models say they save more than their error
    held = plans.get(current_kind) if current_kind is not None else None
    if held is not None and held in open_plans and held.feasible \
            and power_w(held) * (1.0 - switch_saving) <= power_w(best):
        return held, plans
    return best, plans


def plan_power_w(pred: Predictor, plan: Plan, load: WindowLoad, spec: ClusterSpec, rule: ClockRule) -> float | None:
    """What the pool models predict `plan`'s GPUs draw at `load` as it is (no headroom), parked ones included, as
    the plan search prices them; None if the plan cannot hold that load (the model has no figure for it)."""
    rule = rule if rule.objective == "total" else replace(rule, objective="total")
    if plan.mixed is not None:
        pools = mixed_power(pred, plan.mixed, load, spec, rule)
    elif plan.prefill is not None and plan.decode is not None:
        pools = prefill_power(pred, plan.prefill, load, spec, rule) + decode_power(pred, plan.decode, load, spec, rule)
    else:
        return None
    return pools + plan.parked * spec.parked_power_w if pools < INFEASIBLE else None

"""The baselines' prefill/decode instance pools: BiScale's per window and DistServe's goodput placement.

DistServe sizes as its paper does (Zhong et al., OSDI'24, Algorithm 1): per phase, instances of one
configuration replicated until they hold the load, the configuration chosen for goodput per GPU, which
at a given load is the pool with the fewest GPUs; GPUs it does not need stay out of its plan. Only a
load no such placement holds falls back to the all-GPU search.

Their instances are whole-model replicas (`tp` GPUs running both halves at one clock), built with
`colocated.py`'s helpers; the colocated pools themselves (DynamoLLM's, SGLang's static TP, and the
replicas AFlex weighs) are there, AFlex's split pools in `pool_sizing.py`, and where a GPU outside a plan
waits in `parking_rule.py`. Each placement in full: docs/architecture.md, "Baseline placements".
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from shared.perf import Predictor
from shared.policy.colocated import instance_pool, instance_tps, sized_on_total, with_headroom
from shared.policy.operating_point import ClockRule, PoolShape
from shared.policy.pool_sizing import INFEASIBLE, ClusterSpec, Plan, WindowLoad, decode_power, prefill_power


def _pd_candidates(pred: Predictor, load: WindowLoad, spec: ClusterSpec, rule: ClockRule,
                   ) -> tuple[dict[PoolShape, float], dict[PoolShape, float]]:
    """Predicted power of every prefill and every decode instance pool that fits the cluster (on a live
    mesh, `spec.colocated_groups`: of the sizes and counts of its whole-model workers)."""
    pre: dict[PoolShape, float] = {}
    dec: dict[PoolShape, float] = {}
    groups = spec.colocated_groups
    for tp in instance_tps(spec, spec.gpus - 1):
        most = (spec.gpus - 1) // tp if groups is None else groups.count(tp)
        for replicas in range(1, most + 1):
            shape = instance_pool(replicas, tp, spec)
            pre[shape] = prefill_power(pred, shape, load, spec, rule)
            dec[shape] = decode_power(pred, shape, load, spec, rule)
    return pre, dec


def pd_formable(ps: PoolShape, ds: PoolShape, spec: ClusterSpec) -> bool:
    """Whether a prefill and a decode instance pool fit the cluster together: its GPUs, or on a live mesh its
    whole-model workers (each replica one worker of its TP)."""
    if spec.colocated_groups is None:
        return ps.gpus + ds.gpus <= spec.gpus
    need = Counter({ps.tp: ps.replicas})
    need[ds.tp] += ds.replicas
    have = Counter(spec.colocated_groups)
    return all(have[tp] >= n for tp, n in need.items())


def smallest_pd_instances(spec: ClusterSpec) -> int:
    """The fewest GPUs a P/D plan of instances takes (two replicas of the smallest TP the cluster forms that
    holds the model); 0 when it forms no two."""
    tps = [tp for tp in instance_tps(spec, spec.gpus)
           if spec.colocated_groups is None or spec.colocated_groups.count(tp) >= 2]
    tps = [tp for tp in tps if 2 * tp <= spec.gpus]
    return 2 * tps[0] if tps else 0


def provision_pd(pred: Predictor, load: WindowLoad, spec: ClusterSpec, rule: ClockRule, headroom: float = 1.3,
                 use_all: bool = False) -> Plan:
    """P/D disaggregated instance pools with the least predicted power (BiScale's coarse tier, and AFlex's
    "pd-colocated" kind); with `use_all` they hold every GPU between them."""
    hl, rule = with_headroom(load, headroom), sized_on_total(rule)
    pre, dec = _pd_candidates(pred, hl, spec, rule)
    best: tuple[float, PoolShape, PoolShape] | None = None
    for ps, pp in pre.items():
        for ds, dp in dec.items():
            used = ps.gpus + ds.gpus
            if not pd_formable(ps, ds, spec) or (use_all and used != spec.gpus):
                continue
            total = pp + dp + (spec.gpus - used) * spec.parked_power_w
            if best is None or total < best[0]:
                best = (total, ps, ds)
    if best is None:
        raise ValueError(f"{spec.gpus} GPUs cannot hold a prefill and a decode instance pool")
    total, ps, ds = best
    return Plan(ps, ds, None, spec.gpus - ps.gpus - ds.gpus, total, total < INFEASIBLE)


@dataclass(frozen=True)
class Goodput:
    """A placement's goodput: the largest multiple of the reference load both pools hold."""

    prefill: PoolShape
    decode: PoolShape
    load_multiple: float
    power_w: float
    sized: bool = True  # replicated up to the load (False: the all-GPU fallback, for a load nothing smaller holds)


def _feasible(pred: Predictor, ps: PoolShape, ds: PoolShape, load: WindowLoad, spec: ClusterSpec,
              rule: ClockRule) -> tuple[bool, float]:
    pp = prefill_power(pred, ps, load, spec, rule)
    dp = decode_power(pred, ds, load, spec, rule)
    return pp < INFEASIBLE and dp < INFEASIBLE, pp + dp


def _phase_power(pred: Predictor, phase: str, shape: PoolShape, load: WindowLoad, spec: ClusterSpec,
                 rule: ClockRule) -> float:
    return (prefill_power if phase == "prefill" else decode_power)(pred, shape, load, spec, rule)


def _largest_multiple(holds: Callable[[WindowLoad], bool], load: WindowLoad, max_multiple: float, steps: int) -> float:
    """The largest multiple of `load` that `holds` (bisection over [0, `max_multiple`], `steps` halvings)."""
    lo, hi = 0.0, max_multiple
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if holds(with_headroom(load, mid)) else (lo, mid)
    return lo


def _holds(pred: Predictor, phase: str, shape: PoolShape, load: WindowLoad, spec: ClusterSpec, rule: ClockRule,
           max_multiple: float, steps: int) -> float:
    """The largest multiple of `load` `shape` serves in `phase` within its SLO."""
    return _largest_multiple(lambda w: _phase_power(pred, phase, shape, w, spec, rule) < INFEASIBLE, load,
                             max_multiple, steps)


def _replicated(pred: Predictor, phase: str, load: WindowLoad, spec: ClusterSpec, rule: ClockRule,
                max_gpus: int, max_multiple: float, steps: int) -> PoolShape | None:
    """DistServe's sizing of one phase: its objective, goodput per GPU, at this load. For each instance TP,
    the fewest instances that hold `load`; of those pools the one with the fewest GPUs (ties: the higher
    goodput per GPU of one instance). None if `max_gpus` cannot hold it."""
    best: tuple[int, float, PoolShape] | None = None  # (GPUs, -goodput per GPU of one instance, pool)
    for tp in instance_tps(spec, max_gpus):
        one = _holds(pred, phase, instance_pool(1, tp, spec), load, spec, rule, max_multiple, steps)
        replicas = max(1, math.ceil(1.0 / one - 1e-9)) if one > 0 else 1
        while replicas * tp <= max_gpus:
            shape = instance_pool(replicas, tp, spec)
            if _phase_power(pred, phase, shape, load, spec, rule) < INFEASIBLE:
                cand = (shape.gpus, -one / tp, shape)
                if best is None or cand[:2] < best[:2]:
                    best = cand
                break
            replicas += 1
    return best[2] if best is not None else None


def distserve_placement(pred: Predictor, load: WindowLoad, spec: ClusterSpec, rule: ClockRule, headroom: float = 1.3,
                        max_multiple: float = 16.0, steps: int = 10) -> Goodput:
    """DistServe's placement for `load` × `headroom`: each phase replicated up to it (`_replicated`); when
    the two pools do not fit the cluster, the all-GPU placement with the largest goodput (`all_gpu_goodput`)."""
    rule = sized_on_total(rule)
    hl = with_headroom(load, headroom)
    ps = _replicated(pred, "prefill", hl, spec, rule, spec.gpus - 1, max_multiple, steps)
    ds = _replicated(pred, "decode", hl, spec, rule, spec.gpus - 1, max_multiple, steps)
    if ps is not None and ds is not None and ps.gpus + ds.gpus <= spec.gpus:
        multiple = min(_holds(pred, "prefill", ps, load, spec, rule, max_multiple, steps),
                       _holds(pred, "decode", ds, load, spec, rule, max_multiple, steps))
        return Goodput(ps, ds, multiple, _feasible(pred, ps, ds, load, spec, rule)[1])
    return all_gpu_goodput(pred, load, spec, rule, max_multiple, steps)


def all_gpu_goodput(pred: Predictor, load: WindowLoad, spec: ClusterSpec, rule: ClockRule,
                    max_multiple: float = 16.0, steps: int = 10) -> Goodput:
    """Every P/D placement that uses all GPUs, scored by the largest multiple of `load` (bisection, `steps`
    halvings) at which both pools are predicted feasible."""
    rule = sized_on_total(rule)
    best: Goodput | None = None
    tps = instance_tps(spec, spec.gpus - 1)
    for tp_p in tps:
        for r_p in range(1, (spec.gpus - 1) // tp_p + 1):
            rest = spec.gpus - r_p * tp_p
            for tp_d in tps:
                if rest % tp_d:
                    continue
                ps, ds = instance_pool(r_p, tp_p, spec), instance_pool(rest // tp_d, tp_d, spec)
                def both_hold(w: WindowLoad, ps: PoolShape = ps, ds: PoolShape = ds) -> bool:
                    return _feasible(pred, ps, ds, w, spec, rule)[0]
                lo = _largest_multiple(both_hold, load, max_multiple, steps)
                _, power = _feasible(pred, ps, ds, load, spec, rule)
                cand = Goodput(ps, ds, lo, power, sized=False)
                if best is None or (cand.load_multiple, -cand.power_w) > (best.load_multiple, -best.power_w):
                    best = cand
    if best is None:
        raise ValueError(f"{spec.gpus} GPUs cannot hold a prefill and a decode instance pool using every GPU")
    return best

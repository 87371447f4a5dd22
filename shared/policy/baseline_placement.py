"""The baselines' prefill/decode instance pools: BiScale's per window and DistServe's goodput placement.

Their instances are whole-model replicas (`tp` GPUs running both halves at one clock), built with
`colocated.py`'s helpers; the colocated pools themselves (DynamoLLM's, SGLang's static TP, and the
replicas AFlex weighs) are there, AFlex's split pools in `pool_sizing.py`, and where a GPU outside a plan
waits in `parking_rule.py`. Each placement in full: docs/architecture.md, "Baseline placements".
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.perf import Predictor
from shared.policy.colocated import instance_pool, instance_tps, sized_on_total, with_headroom
from shared.policy.operating_point import ClockRule, PoolShape
from shared.policy.pool_sizing import INFEASIBLE, ClusterSpec, Plan, WindowLoad, decode_power, prefill_power


def _pd_candidates(pred: Predictor, load: WindowLoad, spec: ClusterSpec, rule: ClockRule,
                   ) -> tuple[dict[PoolShape, float], dict[PoolShape, float]]:
    """Predicted power of every prefill and every decode instance pool that fits the cluster."""
    pre: dict[PoolShape, float] = {}
    dec: dict[PoolShape, float] = {}
    for tp in instance_tps(spec, spec.gpus - 1):
        for replicas in range(1, (spec.gpus - 1) // tp + 1):
            shape = instance_pool(replicas, tp, spec)
            pre[shape] = prefill_power(pred, shape, load, spec, rule)
            dec[shape] = decode_power(pred, shape, load, spec, rule)
    return pre, dec


def provision_pd(pred: Predictor, load: WindowLoad, spec: ClusterSpec, rule: ClockRule, headroom: float = 1.3,
                 use_all: bool = False) -> Plan:
    """P/D disaggregated instance pools with the least predicted power (BiScale's coarse tier); with
    `use_all` they hold every GPU between them."""
    hl, rule = with_headroom(load, headroom), sized_on_total(rule)
    pre, dec = _pd_candidates(pred, hl, spec, rule)
    best: tuple[float, PoolShape, PoolShape] | None = None
    for ps, pp in pre.items():
        for ds, dp in dec.items():
            used = ps.gpus + ds.gpus
            if used > spec.gpus or (use_all and used != spec.gpus):
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


def _feasible(pred: Predictor, ps: PoolShape, ds: PoolShape, load: WindowLoad, spec: ClusterSpec,
              rule: ClockRule) -> tuple[bool, float]:
    pp = prefill_power(pred, ps, load, spec, rule)
    dp = decode_power(pred, ds, load, spec, rule)
    return pp < INFEASIBLE and dp < INFEASIBLE, pp + dp


def distserve_placement(pred: Predictor, load: WindowLoad, spec: ClusterSpec, rule: ClockRule,
                        max_multiple: float = 16.0, steps: int = 10) -> Goodput:
    """DistServe's search: every P/D placement that uses all GPUs, scored by the largest multiple of
    `load` (bisection, `steps` halvings) at which both pools are predicted feasible."""
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
                lo, hi = 0.0, max_multiple
                for _ in range(steps):
                    mid = (lo + hi) / 2
                    ok, _ = _feasible(pred, ps, ds, with_headroom(load, mid), spec, rule)
                    lo, hi = (mid, hi) if ok else (lo, mid)
                _, power = _feasible(pred, ps, ds, load, spec, rule)
                cand = Goodput(ps, ds, lo, power)
                if best is None or (cand.load_multiple, -cand.power_w) > (best.load_multiple, -best.power_w):
                    best = cand
    if best is None:
        raise ValueError(f"{spec.gpus} GPUs cannot hold a prefill and a decode instance pool using every GPU")
    return best

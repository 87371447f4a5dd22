"""Placements of the baselines that do not split attention from FFN, and where GPUs outside a plan go.

AFlex's own pools are `provision.provision`; the paper's baselines place whole-model instances
(replicas of `tp` GPUs running both halves at one clock): SGLang's static TP, DynamoLLM's per-window
colocated pool, BiScale's and DistServe's prefill/decode pools. `parking_state` is the one rule for
where a GPU outside a plan waits. Each placement in full: docs/architecture.md, "Baseline placements".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shared.kinds import PARKING_CHOICES, ParkedState, ParkingChoice
from shared.perf import Predictor
from shared.policy.operating_point import ClockRule, PoolShape
from shared.policy.provision import (
    INFEASIBLE,
    ClusterSpec,
    Plan,
    WindowLoad,
    decode_power,
    long_prompt_time,
    mixed_power,
    prefill_power,
)

TP_DEGREES = (1, 2, 4, 8)


def instance_tps(spec: ClusterSpec, max_gpus: int, weight_fraction: float = 0.75) -> list[int]:
    """TP degrees whose instance holds the whole model in `weight_fraction` of its memory."""
    weights = spec.attention_weight_bytes + spec.ffn_weight_bytes
    return [tp for tp in TP_DEGREES if weights <= weight_fraction * tp * spec.gpu_memory_bytes and tp <= max_gpus]


def colocated_options(spec: ClusterSpec) -> list[tuple[int, int]]:
    """(TP, most replicas) of the colocated pools the cluster can run: any TP that holds the model, or on a
    live mesh (`spec.colocated_workers`) TP 1 on the workers that loaded both halves."""
    fits = instance_tps(spec, spec.gpus)
    if spec.colocated_workers is not None:
        return [(1, spec.colocated_workers)] if 1 in fits and spec.colocated_workers > 0 else []
    return [(tp, spec.gpus // tp) for tp in fits]


def colocated_tp(pred: Predictor | None, spec: ClusterSpec, p90_prompt: float = 0.0) -> int:
    """TP of a static colocated replica: the smallest that holds the model and, given a predictor and a
    p90 prompt, runs that prompt alone within the TTFT budget at the top clock (else the fastest)."""
    fits = instance_tps(spec, spec.gpus)
    if not fits:
        raise ValueError(f"{spec.gpus} GPUs cannot hold the model colocated")
    if pred is None or p90_prompt <= 0:
        return fits[0]
    times = {}
    for tp in fits:
        shape = PoolShape(split=False, replicas=spec.gpus // tp, tp=tp, link_bytes_s=spec.link_bytes_s)
        times[tp] = long_prompt_time(pred, shape, p90_prompt)
        if times[tp] <= spec.ttft_budget_s:
            return tp
    return min(times, key=lambda k: times[k])


def _instances(replicas: int, tp: int, spec: ClusterSpec) -> PoolShape:
    return PoolShape(split=False, replicas=replicas, tp=tp, link_bytes_s=spec.link_bytes_s)


def _total(rule: ClockRule) -> ClockRule:
    # pools are sized on whole-iteration energy (as `provision`): a conservative, stable fixed point
    return rule if rule.objective == "total" else replace(rule, objective="total")


def _headroom(load: WindowLoad, headroom: float) -> WindowLoad:
    return WindowLoad(load.rate_rps * headroom, load.mean_prompt, load.mean_output, load.p90_prompt)


def provision_colocated(pred: Predictor, load: WindowLoad, spec: ClusterSpec, rule: ClockRule,
                        headroom: float = 1.3) -> Plan:
    """DynamoLLM: the instance count and TP of one colocated pool with the least predicted power for
    `load` × `headroom`; GPUs left out are parked. Falls back to every GPU when nothing is feasible."""
    hl, rule = _headroom(load, headroom), _total(rule)
    best: tuple[float, PoolShape] | None = None
    for tp, most in colocated_options(spec):
        for replicas in range(1, most + 1):
            shape = _instances(replicas, tp, spec)
            p = mixed_power(pred, shape, hl, spec, rule) + (spec.gpus - shape.gpus) * spec.parked_power_w
            if best is None or p < best[0]:
                best = (p, shape)
    if best is None:
        raise ValueError(f"{spec.gpus} GPUs cannot hold the model colocated")
    p, shape = best
    return Plan(None, None, shape, spec.gpus - shape.gpus, p, p < INFEASIBLE)


def _pd_candidates(pred: Predictor, load: WindowLoad, spec: ClusterSpec, rule: ClockRule,
                   ) -> tuple[dict[PoolShape, float], dict[PoolShape, float]]:
    """Predicted power of every prefill and every decode instance pool that fits the cluster."""
    pre: dict[PoolShape, float] = {}
    dec: dict[PoolShape, float] = {}
    for tp in instance_tps(spec, spec.gpus - 1):
        for replicas in range(1, (spec.gpus - 1) // tp + 1):
            shape = _instances(replicas, tp, spec)
            pre[shape] = prefill_power(pred, shape, load, spec, rule)
            dec[shape] = decode_power(pred, shape, load, spec, rule)
    return pre, dec


def provision_pd(pred: Predictor, load: WindowLoad, spec: ClusterSpec, rule: ClockRule, headroom: float = 1.3,
                 use_all: bool = False) -> Plan:
    """P/D disaggregated instance pools with the least predicted power (BiScale's coarse tier); with
    `use_all` they hold every GPU between them."""
    hl, rule = _headroom(load, headroom), _total(rule)
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
    rule = _total(rule)
    best: Goodput | None = None
    tps = instance_tps(spec, spec.gpus - 1)
    for tp_p in tps:
        for r_p in range(1, (spec.gpus - 1) // tp_p + 1):
            rest = spec.gpus - r_p * tp_p
            for tp_d in tps:
                if rest % tp_d:
                    continue
                ps, ds = _instances(r_p, tp_p, spec), _instances(rest // tp_d, tp_d, spec)
                lo, hi = 0.0, max_multiple
                for _ in range(steps):
                    mid = (lo + hi) / 2
                    ok, _ = _feasible(pred, ps, ds, _headroom(load, mid), spec, rule)
                    lo, hi = (mid, hi) if ok else (lo, mid)
                _, power = _feasible(pred, ps, ds, load, spec, rule)
                cand = Goodput(ps, ds, lo, power)
                if best is None or (cand.load_multiple, -cand.power_w) > (best.load_multiple, -best.power_w):
                    best = cand
    if best is None:
        raise ValueError(f"{spec.gpus} GPUs cannot hold a prefill and a decode instance pool using every GPU")
    return best


def parking_state(choice: ParkingChoice, expected_parked_s: float, warm_w: float, cold_w: float,
                  cold_rejoin_j: float) -> ParkedState:
    """Where a GPU leaving the plan waits: `choice` if "warm" or "cold"; "auto" parks cold when the power
    saved over the time it is expected to stay out pays for the model load that brings it back. Checked at
    run time too: a choice may come from an untyped config."""
    if choice not in PARKING_CHOICES:
        raise ValueError(f"unknown parking state {choice!r}; known: {', '.join(PARKING_CHOICES)}")
    if choice != "auto":
        return choice
    return "cold" if expected_parked_s * (warm_w - cold_w) > cold_rejoin_j else "warm"

"""Whole-model replicas (attention and FFN colocated, `tp` GPUs each, one clock): the pools AFlex's elastic
planner weighs beside its split pools (`footprint.py`), DynamoLLM's per-window pool and SGLang's static TP.

The instance helpers here (which TPs hold the model, a pool of instances, the sizing objective and headroom)
serve the baselines' P/D instance pools too (`baseline_placement.py`).
"""

from __future__ import annotations

from dataclasses import replace

from shared.perf import Predictor
from shared.policy.operating_point import ClockRule, PoolShape
from shared.policy.pool_sizing import INFEASIBLE, ClusterSpec, Plan, WindowLoad, long_prompt_time, mixed_power


def instance_tps(spec: ClusterSpec, max_gpus: int, weight_fraction: float = 0.75) -> list[int]:
    """TP degrees the live mesh can form (`spec.whole_tps`) whose instance holds the whole model in
    `weight_fraction` of its memory."""
    weights = spec.attention_weight_bytes + spec.ffn_weight_bytes
    return [tp for tp in spec.whole_tps if weights <= weight_fraction * tp * spec.gpu_memory_bytes and tp <= max_gpus]


def colocated_options(spec: ClusterSpec) -> list[tuple[int, int]]:
    """(TP, most replicas) of the colocated pools the cluster can run: any TP that holds the model, or on a
    live mesh (`spec.colocated_groups`) the sizes of its workers that loaded both halves, one replica each."""
    fits = instance_tps(spec, spec.gpus)
    if spec.colocated_groups is not None:
        groups = spec.colocated_groups
        return [(tp, groups.count(tp)) for tp in sorted(set(groups)) if tp in fits]
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
        shape = instance_pool(spec.gpus // tp, tp, spec)
        times[tp] = long_prompt_time(pred, shape, p90_prompt)
        if times[tp] <= spec.ttft_budget_s:
            return tp
    return min(times, key=lambda k: times[k])


def instance_pool(replicas: int, tp: int, spec: ClusterSpec) -> PoolShape:
    """`replicas` whole-model instances of `tp` GPUs; each instance's all-reduces stay inside its TP group."""
    return PoolShape(split=False, replicas=replicas, tp=tp, link_bytes_s=spec.group_link_bytes_s(tp))


def sized_on_total(rule: ClockRule) -> ClockRule:
    """`rule` with the whole-iteration energy objective: pools are sized on it (as `pool_sizing.provision`),
    a conservative, stable fixed point."""
    return rule if rule.objective == "total" else replace(rule, objective="total")


def with_headroom(load: WindowLoad, headroom: float) -> WindowLoad:
    """`load` with its arrival rate times `headroom` (the lengths stay)."""
    return WindowLoad(load.rate_rps * headroom, load.mean_prompt, load.mean_output, load.p90_prompt)


def provision_colocated(pred: Predictor, load: WindowLoad, spec: ClusterSpec, rule: ClockRule,
                        headroom: float = 1.3) -> Plan:
    """DynamoLLM: the instance count and TP of one colocated pool with the least predicted power for
    `load` × `headroom`; GPUs left out are parked. Falls back to every GPU when nothing is feasible."""
    hl, rule = with_headroom(load, headroom), sized_on_total(rule)
    best: tuple[float, PoolShape] | None = None
    for tp, most in colocated_options(spec):
        for replicas in range(1, most + 1):
            shape = instance_pool(replicas, tp, spec)
            p = mixed_power(pred, shape, hl, spec, rule) + (spec.gpus - shape.gpus) * spec.parked_power_w
            if best is None or p < best[0]:
                best = (p, shape)
    if best is None:
        raise ValueError(f"{spec.gpus} GPUs cannot hold the model colocated")
    p, shape = best
    return Plan(None, None, shape, spec.gpus - shape.gpus, p, p < INFEASIBLE)

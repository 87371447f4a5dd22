"""Provisioning for one window: how many attention and FFN GPUs serve, in which pools.

For the load of the coming window (arrival rate, mean prompt and output lengths, times a headroom),
every candidate pool size is evaluated with the predictors and the same `choose_operating_point` the
iterations use:

- decode pool (a attention, f FFN): batch B from Little's law (B = token rate × iteration time,
  iterated to a fixed point); feasible when the iteration meets the TPOT budget and the KV cache of
  the a attention GPUs holds B sequences; power = energy per iteration / iteration time.
- prefill pool (a attention GPUs in TP groups of 1, 2, 4 or 8, f FFN): iterations of 1, 2 or 4 mean
  prompts, the smallest batch that keeps up, since the queue grows only until its batches do (at light
  load one prompt an iteration, which the scheduler cannot pipeline against itself; the model took the
  cheapest of the three before, a batch of four pipelined at depth 2 that never formed, and
  under-priced P/D prefill pools, issue 38); feasible when the window's p90 prompt alone fits the TTFT
  budget on one attention group at the top clock, an iteration fits the batching rule's drain cap
  (`prefill_iter_frac` of the TTFT budget) and utilisation stays below `max_utilisation` (queueing);
  power = busy share at the chosen clocks + idle share at context-idle power.

The plan minimises total power, counting GPUs left out (parked) at `parked_power_w`; when no plan holds
the load, the least overloaded that parks nothing (an overload's penalty can tie across pool sizes whose
bottleneck is elsewhere, and the smallest of them would park GPUs the burst needs). With fewer
than `min_pd_gpus` GPUs the cluster is one mixed split pool (no prefill/decode pools,
`provision_mixed`). AFlex's planner weighs these beside colocated replicas (`footprint.py`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from shared.gpu.emulated import GPUProfile
from shared.kinds import PlanKind
from shared.model.config import ModelArgs
from shared.model.sizes import attention_weight_bytes, ffn_weight_bytes, kv_bytes_per_token
from shared.perf import Predictor
from shared.policy.operating_point import BatchStats, ClockRule, OperatingPoint, PoolShape, choose_operating_point
from shared.policy.specs import SHARED_BATCHING


@dataclass(frozen=True)
class WindowLoad:
    rate_rps: float
    mean_prompt: float
    mean_output: float
    p90_prompt: float = 0.0  # > 0: a prompt this long, alone, must fit the TTFT budget on one group


GPU_MEMORY_BYTES = 80e9  # the modelled GPUs' memory (A800/A100/H100 80 GB)
SLO_BUDGET_SHARE = 0.85  # plans meet this share of each SLO
TIE_SHARE = 0.01  # pool sizes whose predicted powers differ by less than this share are a tie (the fewest GPUs win)
TP_DEGREES = (1, 2, 4, 8)  # the tensor-parallel group sizes plans weigh


@dataclass(frozen=True)
class LiveGroups:
    """A live mesh's workers as the groups they are (each a size in devices, `--attention-tp`, `--ffn-tp` x
    `--ffn-ep`): what the live planner may plan with. Its GPUs are their devices."""

    attention: tuple[int, ...]  # each attention worker's size
    ffn: tuple[int, ...]  # each FFN worker's size
    whole: tuple[int, ...]  # the size of each attention worker that holds both halves

    @classmethod
    def ones(cls, attention: int, ffn: int, whole: int = 0) -> LiveGroups:
        """Workers of one device each: `attention` attention workers (`whole` of them holding both halves)."""
        return cls((1,) * attention, (1,) * ffn, (1,) * whole)

    @property
    def gpus(self) -> int:
        return sum(self.attention) + sum(self.ffn)

    def limit(self, spec: ClusterSpec) -> ClusterSpec:
        """`spec` held to these groups: attention pools of the attention workers' sizes, FFN pools of what some of
        the FFN workers sum to, colocated replicas of the whole-model workers' sizes."""
        sums = {0}
        for size in self.ffn:
            sums |= {s + size for s in sums}
        return replace(spec, max_attention=sum(self.attention), max_ffn=sum(self.ffn), colocated_groups=self.whole,
                       attention_tps=tuple(sorted(set(self.attention))), ffn_sizes=tuple(sorted(sums - {0})))


@dataclass(frozen=True)
class ClusterSpec:
    gpus: int
    gpu_memory_bytes: float
    attention_weight_bytes: float
    ffn_weight_bytes: float
    kv_bytes_per_token: float
    link_bytes_s: float
    ttft_budget_s: float
    tpot_budget_s: float
    parked_power_w: float
    memory_fraction: float = 0.9
    # a live mesh's workers load one half each: at most this many can serve attention / the FFN (None: any
    # GPU can take either role, as in the simulator's cluster)
    max_attention: int | None = None
    max_ffn: int | None = None
    # a live mesh: the group size (TP) of each worker that holds both halves (a colocated replica is one of
    # them); None: any GPU or TP group can, as in the simulator
    colocated_groups: tuple[int, ...] | None = None
    # GPUs per node (0: every GPU on the `link_bytes_s` fabric) and what a GPU moves to another node (bytes/s):
    # a group whose per-layer traffic crosses nodes runs at the slower link (`group_link_bytes_s`)
    node_gpus: int = 0
    inter_node_bytes_s: float = 0.0
    # the group sizes the live mesh can form for this model (`group_fit.formable`), or a live mesh has: whole-model
    # replicas, attention groups (ascending: a decode or mixed pool's groups are the smallest) and a split pool's
    # FFN GPUs (one FFN group, or a live mesh's FFN workers together; None: any count); a plan uses no other
    whole_tps: tuple[int, ...] = TP_DEGREES
    attention_tps: tuple[int, ...] = TP_DEGREES
    ffn_sizes: tuple[int, ...] | None = None

    @classmethod
    def for_model(cls, args: ModelArgs, gpus: int, *, ttft_slo_s: float, tpot_slo_s: float, link_bytes_s: float,
                  parked_power_w: float, gpu_memory_bytes: float = GPU_MEMORY_BYTES, max_attention: int | None = None,
                  max_ffn: int | None = None, node_gpus: int = 0, inter_node_bytes_s: float = 0.0,
                  groups: LiveGroups | None = None) -> ClusterSpec:
        """The cluster that serves `args` on `gpus` GPUs, planned to `SLO_BUDGET_SHARE` of each SLO (the rest is
        the queueing and dispatch a plan does not see): the simulator's and the live scheduler's one spec. The
        simulator's may form any group the model splits over (`group_fit`); a live mesh's (`groups`) only the
        groups it has."""
        from shared.policy.group_fit import ffn_group_formable, formable

        spec = cls(gpus, gpu_memory_bytes, attention_weight_bytes(args), ffn_weight_bytes(args),
                   kv_bytes_per_token(args), link_bytes_s, ttft_slo_s * SLO_BUDGET_SHARE,
                   tpot_slo_s * SLO_BUDGET_SHARE, parked_power_w, max_attention=max_attention, max_ffn=max_ffn,
                   node_gpus=node_gpus, inter_node_bytes_s=inter_node_bytes_s,
                   whole_tps=tuple(tp for tp in TP_DEGREES if formable(args, "whole", tp)),
                   attention_tps=tuple(tp for tp in TP_DEGREES if formable(args, "attention", tp)),
                   ffn_sizes=tuple(f for f in range(1, gpus + 1) if ffn_group_formable(args, f)))
        return spec if groups is None else groups.limit(spec)

    def group_link_bytes_s(self, gpus: int) -> float:
        """The link a group of `gpus` GPUs exchanging tensors every layer runs at: the intra-node fabric while
        the group fits one node, the inter-node network once it cannot (a ring's slowest hop sets its pace)."""
        if self.node_gpus > 0 and self.inter_node_bytes_s > 0 and gpus > self.node_gpus:
            return self.inter_node_bytes_s
        return self.link_bytes_s

    def role_fits(self, attention: int, ffn: int) -> bool:
        """Whether `attention` attention and `ffn` FFN GPUs, together, fit the cluster and its role limits."""
        return (attention + ffn <= self.gpus and (self.max_attention is None or attention <= self.max_attention)
                and (self.max_ffn is None or ffn <= self.max_ffn))

    def ffn_fits(self, ffn: int) -> bool:
        """Whether a split pool may take `ffn` FFN GPUs (`ffn_sizes`)."""
        return self.ffn_sizes is None or ffn in self.ffn_sizes

    @property
    def least_attention_tp(self) -> int:
        """A decode or mixed pool's attention groups: the smallest the cluster forms."""
        return self.attention_tps[0] if self.attention_tps else 1

    @property
    def ffn_min(self) -> int:
        return max(1, math.ceil(self.ffn_weight_bytes / (self.memory_fraction * self.gpu_memory_bytes)))

    def kv_capacity_tokens(self, attention_gpus: int) -> float:
        free = self.memory_fraction * self.gpu_memory_bytes - self.attention_weight_bytes
        return max(0.0, attention_gpus * free / self.kv_bytes_per_token)

    def pool_kv_capacity_tokens(self, shape: PoolShape) -> float:
        """KV tokens a pool holds: its attention GPUs' free memory (split), or each replica's memory less
        the whole model's weights (colocated)."""
        if shape.split:
            return self.kv_capacity_tokens(shape.attention)
        weights = self.attention_weight_bytes + self.ffn_weight_bytes
        free = self.memory_fraction * shape.tp * self.gpu_memory_bytes - weights
        return max(0.0, shape.replicas * free / self.kv_bytes_per_token)


@dataclass(frozen=True)
class Plan:
    prefill: PoolShape | None
    decode: PoolShape | None
    mixed: PoolShape | None
    parked: int
    predicted_power_w: float
    feasible: bool

    @property
    def gpus(self) -> int:
        return sum(p.gpus for p in (self.prefill, self.decode, self.mixed) if p is not None)

    @property
    def kind(self) -> PlanKind:
        """"pd" (split prefill and decode pools), "pd-colocated" (prefill and decode pools of whole-model
        replicas), "mixed" (one A/F split pool) or "colocated" (whole-model replicas)."""
        if self.mixed is None:
            return pools_kind({"prefill": self.prefill} if self.prefill is not None else {})
        return "mixed" if self.mixed.split else "colocated"

    def pools(self) -> dict[str, PoolShape]:
        """The plan's pools by name: "prefill" and "decode", or one "mixed" or "colocated" pool."""
        if self.mixed is not None:
            return {self.kind: self.mixed}
        return {k: v for k, v in (("prefill", self.prefill), ("decode", self.decode)) if v is not None}


def pools_kind(pools: Mapping[str, PoolShape]) -> PlanKind:
    """The kind of a plan with these pools by name (`Plan.pools`): P/D pools, split or of replicas, or its one
    pool's own name ("mixed" or "colocated")."""
    if "prefill" in pools or not pools:
        return "pd" if not pools or pools["prefill"].split else "pd-colocated"
    return "mixed" if "mixed" in pools else "colocated"


INFEASIBLE = 1e9


def decode_point(pred: Predictor, shape: PoolShape, load: WindowLoad, spec: ClusterSpec,
                 rule: ClockRule) -> tuple[OperatingPoint, float]:
    """The decode pool's planned operating point at this load, and its overload (> 1: it cannot hold it):
    batch B from Little's law (B = token rate × iteration time), iterated to a fixed point."""
    rate = load.rate_rps * load.mean_output
    per_seq_ctx = load.mean_prompt + load.mean_output / 2
    t = 0.05
    op = None
    for _ in range(3):
        b = max(1.0, rate * t)
        stats = BatchStats("decode", b, b * per_seq_ctx, b * per_seq_ctx, b, n_seqs=b)
        op = choose_operating_point(pred, shape, stats, spec.tpot_budget_s, rule)
        t = op.time_s
    assert op is not None
    b = max(1.0, rate * t)
    kv_need = b * (load.mean_prompt + load.mean_output)
    over = max(t / spec.tpot_budget_s, kv_need / max(spec.pool_kv_capacity_tokens(shape), 1.0))
    return op, (over if op.feasible else max(over, 1.0 + 1e-9))


def decode_power(pred: Predictor, shape: PoolShape, load: WindowLoad, spec: ClusterSpec, rule: ClockRule) -> float:
    """Predicted power (W) of a decode pool at this load; INFEASIBLE + overload when it cannot hold it."""
    op, over = decode_point(pred, shape, load, spec, rule)
    if over > 1.0:
        return INFEASIBLE * over
    return op.energy_j / op.time_s


def long_prompt_time(pred: Predictor, shape: PoolShape, prompt: float, rule: ClockRule | None = None) -> float:
    """Predicted time (s) of one prompt of `prompt` tokens alone on `shape` at the top clock: it runs on
    one group (a replica, or an attention TP group), so only tensor parallelism shortens it."""
    pairs = prompt * prompt - prompt * (prompt - 1) / 2
    stats = BatchStats("prefill", prompt, prompt, pairs, 1, prompt, prompt, pairs, n_seqs=1)
    top = ClockRule(max_clock=True, depths=(1,))
    return choose_operating_point(pred, shape, stats, 0.0, top if rule is None else rule).time_s


def prefill_point(pred: Predictor, shape: PoolShape, load: WindowLoad, spec: ClusterSpec, rule: ClockRule,
                  max_utilisation: float = 0.6) -> tuple[OperatingPoint | None, float, float]:
    """The prefill pool's planned operating point (None: no prefill load, or none feasible), its predicted
    power (W: busy share at the chosen clocks, idle share at their context-idle power) and that busy share."""
    rate = load.rate_rps * load.mean_prompt
    if rate <= 0:
        return None, shape.gpus * spec.parked_power_w, 0.0
    if load.p90_prompt > 0:
        t_long = long_prompt_time(pred, shape, load.p90_prompt)
        if t_long > spec.ttft_budget_s:
            return None, INFEASIBLE * 10 * t_long / spec.ttft_budget_s, 0.0
    over = INFEASIBLE * 100
    prompt = max(1.0, load.mean_prompt)
    pq = prompt * prompt - prompt * (prompt - 1) / 2
    # an iteration that empties the queue lasts at most this share of the TTFT budget (the batching rule's cap)
    drain_s = SHARED_BATCHING.prefill_iter_frac * spec.ttft_budget_s or spec.ttft_budget_s
    for seqs in (1.0, 2.0, 4.0):  # the queue grows only until its batches keep up: the first that does forms
        chunk = seqs * prompt
        stats = BatchStats("prefill", chunk, chunk, seqs * pq, seqs, prompt, prompt, pq, n_seqs=seqs)
        budget = min(spec.ttft_budget_s / 2.0, drain_s, max_utilisation * chunk / rate)
        op = choose_operating_point(pred, shape, stats, budget, rule)
        if not op.feasible:
            over = min(over, INFEASIBLE * max(1.0, op.time_s / budget))
            continue
        util = rate * op.time_s / chunk
        idle = idle_power_w(pred.profile, shape, op.clock_attention, op.clock_ffn)
        return op, util * op.energy_j / op.time_s + (1 - util) * idle, util
    return None, over, 0.0


def prefill_power(pred: Predictor, shape: PoolShape, load: WindowLoad, spec: ClusterSpec, rule: ClockRule,
                  max_utilisation: float = 0.6) -> float:
    return prefill_point(pred, shape, load, spec, rule, max_utilisation)[1]


def mixed_power(pred: Predictor, shape: PoolShape, load: WindowLoad, spec: ClusterSpec, rule: ClockRule) -> float:
    """Predicted power (W) of one pool serving prefill and decode: for the prefill point's busy share `u`,
    its mixed iterations' power, the decodes riding in them; the rest of the time, the decode pool's power.
    (Charging the decode power through the prefill time as well over-priced colocated replicas by ~10%.)"""
    dp = decode_power(pred, shape, load, spec, rule)
    op, pp, util = prefill_point(pred, shape, load, spec, rule)
    if dp >= INFEASIBLE or pp >= INFEASIBLE:
        return max(dp, pp)
    if op is None:  # no prefill load: the pool only decodes
        return dp
    return (1.0 - util) * dp + util * op.energy_j / op.time_s


def idle_power_w(prof: GPUProfile, shape: PoolShape, clock_attention: float, clock_ffn: float) -> float:
    """The pool's context-idle power (W) with its GPUs waiting at these clocks (a colocated pool runs
    both halves at the attention clock)."""
    if not shape.split:
        return shape.gpus * prof.context_idle_power_at(clock_attention)
    return shape.attention * prof.context_idle_power_at(clock_attention) + shape.ffn * prof.context_idle_power_at(
        clock_ffn)


def _pool(a: int, f: int, spec: ClusterSpec, attention_tp: int = 0) -> PoolShape:
    """A split pool of `a` attention GPUs in groups of `attention_tp` (0: the cluster's smallest) and `f` FFN GPUs."""
    return PoolShape(split=True, attention=a, ffn=f, link_bytes_s=spec.group_link_bytes_s(a + f),
                     attention_tp=attention_tp or spec.least_attention_tp)


def attention_tp_options(a: int, max_tp: int, formable: tuple[int, ...] = TP_DEGREES) -> list[int]:
    """Attention TP degrees for `a` attention GPUs: powers of two dividing `a`, at most `max_tp`
    (the KV heads: a head is not split), that the live mesh can form (`formable`)."""
    return [tp for tp in formable if tp <= max_tp and a % tp == 0]


def provision(pred: Predictor, load: WindowLoad, spec: ClusterSpec, rule: ClockRule, headroom: float = 1.3,
              min_pd_gpus: int = 6, use_all: bool = False, prefill_tp: bool = True) -> Plan:
    """The least-power plan for `load` (times `headroom`); `use_all` spreads every GPU over the pools;
    `prefill_tp` lets the prefill pool's attention GPUs run tensor parallel in groups."""
    hl = WindowLoad(load.rate_rps * headroom, load.mean_prompt, load.mean_output, load.p90_prompt)
    if rule.objective != "total":  # pools are sized on whole-iteration energy (conservative, stable fixed point)
        rule = replace(rule, objective="total")
    n = spec.gpus
    fmin = spec.ffn_min
    if n < min_pd_gpus:
        return provision_mixed(pred, load, spec, rule, headroom, use_all)
    pre: dict[tuple[int, int], tuple[float, int]] = {}  # (attention, FFN) GPUs -> (power, attention TP)
    dec: dict[tuple[int, int], float] = {}
    max_tp = max(1, pred.args.n_kv_heads) if prefill_tp else 1
    for f in range(fmin, n):
        if not spec.ffn_fits(f):
            continue
        for a in range(1, n - f):
            if not spec.role_fits(a, f):
                continue
            for tp in attention_tp_options(a, max_tp, spec.attention_tps):
                pp = prefill_power(pred, _pool(a, f, spec, tp), hl, spec, rule)
                if (a, f) not in pre or pp < pre[(a, f)][0]:
                    pre[(a, f)] = (pp, tp)
            if a % spec.least_attention_tp == 0:
                dec[(a, f)] = decode_power(pred, _pool(a, f, spec), hl, spec, rule)
    choice: tuple[float, tuple[int, int], tuple[int, int]] | None = None
    for (pa, pf), (pp, _) in pre.items():
        for (da, df), dp in dec.items():
            used = pa + pf + da + df
            if not spec.role_fits(pa + da, pf + df) or (use_all and used != n):
                continue
            total = pp + dp + (n - used) * spec.parked_power_w
            if choice is None or total < choice[0]:
                choice = (total, (pa, pf), (da, df))
    if choice is None:
        raise ValueError(f"{n} GPUs cannot hold a prefill and a decode pool")
    if choice[0] >= INFEASIBLE and not use_all:  # no plan holds the load: park nothing
        with contextlib.suppress(ValueError):  # (no P/D plan takes every GPU: the least overloaded, as found)
            return provision(pred, load, spec, rule, headroom, min_pd_gpus, use_all=True, prefill_tp=prefill_tp)
    total, (pa, pf), (da, df) = choice
    ptp = pre[(pa, pf)][1]
    return Plan(_pool(pa, pf, spec, ptp), _pool(da, df, spec), None, n - pa - pf - da - df, total,
                total < INFEASIBLE)


def provision_mixed(pred: Predictor, load: WindowLoad, spec: ClusterSpec, rule: ClockRule, headroom: float = 1.3,
                    use_all: bool = False) -> Plan:
    """One A/F split pool serving prefill and decode: the (attention, FFN) GPUs with the least predicted
    power for `load` × `headroom` (every GPU with `use_all`); the rest parked. Sizes within `TIE_SHARE` of the
    least power count as a tie, which the fewest GPUs win: at a trickle a pool idles whatever its size, and a
    saving the model cannot resolve is no reason to keep a GPU from parking."""
    hl = WindowLoad(load.rate_rps * headroom, load.mean_prompt, load.mean_output, load.p90_prompt)
    rule = rule if rule.objective == "total" else replace(rule, objective="total")
    n, fmin = spec.gpus, spec.ffn_min
    options: list[tuple[float, int, int]] = []  # (power, attention GPUs, FFN GPUs)
    for f in range(fmin, n):
        for a in range(1, n - f + 1):
            if ((use_all and a + f != n) or not spec.role_fits(a, f) or not spec.ffn_fits(f)
                    or a % spec.least_attention_tp):
                continue
            p = mixed_power(pred, _pool(a, f, spec), hl, spec, rule) + (n - a - f) * spec.parked_power_w
            options.append((p, a, f))
    if not options:
        raise ValueError(f"{n} GPUs cannot hold the model split (FFN needs {fmin})")
    least = min(options)[0]
    best = min((o for o in options if o[0] <= least * (1.0 + TIE_SHARE)), key=lambda o: (o[1] + o[2], o[0]))
    if best[0] >= INFEASIBLE and not use_all:  # no pool holds the load: park nothing
        with contextlib.suppress(ValueError):
            return provision_mixed(pred, load, spec, rule, headroom, use_all=True)
    p, a, f = best
    return Plan(None, None, _pool(a, f, spec), n - a - f, p, p < INFEASIBLE)

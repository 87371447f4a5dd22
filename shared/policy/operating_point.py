"""Per-iteration operating point: microbatch depth and a clock per operator, under a latency budget.

`choose_operating_point` scans every candidate depth and every (attention clock, FFN clock) pair of the
predictor's clock table, keeps those whose predicted iteration time meets the budget, and returns
the one with the least predicted energy (the lowest clock is not always the cheapest: static power
makes energy per token U-shaped). In a split pool this is where pipeline slack goes: the side that
is not the bottleneck slows until it nearly becomes it. If nothing meets the budget, the fastest
point wins. `objective="marginal"` scores energy above the pool's context-idle floor (its GPUs' idle
power at the candidate clocks, `idle_floor_w`) instead of the iteration's total (see ClockRule).
With `per_operator=False` both sides share one clock (phase-level DVFS); with `max_clock=True` the
clocks stay at the top (no DVFS); `fixed_mhz` pins all four (the static oracle). Hysteresis: the
current point is kept while it still meets the budget and costs at most `hysteresis` more than the best.
It is two steps, the candidates of a batch (`point_tables`) and the pick under a budget (`select_point`),
so that the simulator can keep the first for a batch that comes back under another budget.

`SloMargin` is the adaptive safety margin: budgets are SLO·(1 − margin); a window with misses
widens it, a clean window with p90 well under the SLO narrows it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.gpu.snap import snap_clock
from shared.perf import Predictor
from shared.policy.headroom import comfortably_inside
from shared.policy.iteration import microbatch_depth
from shared.policy.pipeline import iteration_cost, megascale_depth, seam_transfer_s


@dataclass(frozen=True)
class PoolShape:
    """A pool of GPUs that runs iterations together.

    split=False: `replicas` data-parallel replicas of `tp` GPUs each run both halves.
    split=True: `attention` attention GPUs in data-parallel groups of `attention_tp` (tensor parallel
    inside a group, so one long prompt's attention spreads over the group) and `ffn` FFN GPUs
    (tensor parallel over the FFN weights) with the seam over a link of `link_bytes_s`."""

    split: bool
    attention: int = 1
    ffn: int = 1
    replicas: int = 1
    tp: int = 1
    link_bytes_s: float = 400e9
    attention_tp: int = 1

    @property
    def gpus(self) -> int:
        return self.attention + self.ffn if self.split else self.replicas * self.tp

    @property
    def units(self) -> int:
        """Independent groups a sequence can be placed on: attention groups (split) or replicas."""
        return max(1, self.attention // max(1, self.attention_tp)) if self.split else self.replicas


@dataclass(frozen=True)
class BatchStats:
    """One iteration's work, summed over the pool: new tokens, KV tokens read, score pairs, sequences sampled.

    `seq_*` describe the largest single sequence chunk in it (0: none given). One sequence runs on one
    group (replica, or attention TP group), so the iteration lasts at least that chunk's time there,
    however many groups share the rest of the work. `n_seqs` counts its sequences (0: not given, read
    as one a token, which is exact for decode): the scheduler cuts microbatches between sequences,
    never inside one (`split_microbatches`), so a group runs at most as many as it holds sequences."""

    phase: str  # "prefill" (any prefill chunk in it) or "decode"
    n_tokens: float
    ctx_tokens: float
    pairs: float
    n_sample: float
    seq_tokens: float = 0.0
    seq_ctx: float = 0.0
    seq_pairs: float = 0.0
    n_seqs: float = 0.0

    @property
    def seqs(self) -> float:
        """Its sequences (`n_seqs`, or one a token where not given)."""
        return self.n_seqs if self.n_seqs > 0 else self.n_tokens

    def group_seqs(self, units: int) -> int:
        """The sequences of the busiest of `units` groups sharing the iteration: its depth's ceiling."""
        return max(1, math.ceil(self.seqs / max(1, units) - 1e-9))

    def busy_units(self, units: int) -> int:
        """The groups (replicas, or attention groups) of `units` that hold a sequence: the scheduler places
        whole sequences, so with fewer sequences than groups the rest sit idle this iteration instead of
        each reading its weights for a fraction of a sequence."""
        return max(1, min(max(1, units), math.ceil(self.seqs - 1e-9)))


@dataclass(frozen=True)
class ClockRule:
    max_clock: bool = False
    per_operator: bool = True
    depths: tuple[int, ...] = (1, 2, 3, 4)  # candidates; () means MegaScale-style from the floor
    hysteresis: float = 0.03
    # "total": least energy of the iteration, its GPUs' idle power while it runs included (what a GPU
    # meter reads over the iteration: DynamoLLM/VoltanaLLM). "marginal": least energy above the pool's
    # context-idle floor, which its provisioned GPUs draw whether they compute or wait, so time inside
    # the latency budget is free and a slower point wins unless it costs more dynamic energy.
    # "marginal-decode": marginal for decode-only iterations, total for any with prefill (AFlex): a
    # continuously busy decode pool turns a slower iteration into a larger batch (Little's law), which
    # reads the weights once for more tokens; a prefill pool's slack is the next prompts' queueing time.
    # "idle-aware" (AFlex): marginal for decode-only iterations; a prefill iteration after which the pool's
    # queue is empty is scored by its total energy plus the context-idle power the pool then draws at the
    # same clocks until the next prompt comes (`choose_operating_point`'s `next_prompt_rate_hz`: the
    # expected wait after an iteration of t seconds is exp(-rate·t)/rate for Poisson arrivals). A
    # faster clock leaves a longer wait at a higher idle power; total energy alone never sees that wait,
    # "marginal" never sees that idle power depends on the clock. Without a rate it is "total".
    objective: str = "total"
    # a fixed configuration (the static oracle): ((prefill attention, prefill FFN), (decode attention,
    # decode FFN)) MHz, snapped to the predictor's table; only the depth is still chosen
    fixed_mhz: tuple[tuple[float, float], tuple[float, float]] | None = None


@dataclass(frozen=True)
class OperatingPoint:
    depth: int
    clock_attention: float
    clock_ffn: float
    time_s: float
    energy_j: float
    feasible: bool
    index: tuple[int, int] = (-1, -1)


def _tables(pred: Predictor, shape: PoolShape, s: BatchStats, depth: int, dim: int, layers: int,
            rows: slice = slice(None), cols: slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
    """Predicted (time, energy) over (clock_a, clock_f) for one depth: the clock table's `rows` for
    attention and `cols` for the FFN (a pinned rule asks for one of each, not the whole table)."""
    idle = pred.idle_table
    if shape.split:
        def att(n: float, ctx: float, pairs: float, shard: int) -> tuple[np.ndarray, np.ndarray]:
            t, e = pred.predict("attention", s.phase, n, ctx, pairs, shard=shard)
            return t[rows, None], e[rows, None]

        def ffn(n: float, shard: int) -> tuple[np.ndarray, np.ndarray]:
            t, e = pred.predict("ffn", s.phase, n, shard=shard)
            return t[None, cols], e[None, cols]

        def head(n: float, shard: int) -> tuple[np.ndarray, np.ndarray]:
            t, e = pred.predict("lm_head", "decode", max(1.0, n), shard=shard)
            return t[rows, None], e[rows, None]

        return iteration_cost(att, ffn, head, shape, s, depth, dim, layers, idle[rows, None], idle[None, cols])

    def att1(n: float, ctx: float, pairs: float, shard: int) -> tuple[np.ndarray, np.ndarray]:
        t, e = pred.predict("attention", s.phase, n, ctx, pairs, shard=shard)
        return t[rows], e[rows]

    def ffn1(n: float, shard: int) -> tuple[np.ndarray, np.ndarray]:
        t, e = pred.predict("ffn", s.phase, n, shard=shard)
        return t[rows], e[rows]

    def head1(n: float, shard: int) -> tuple[np.ndarray, np.ndarray]:
        t, e = pred.predict("lm_head", "decode", max(1.0, n), shard=shard)
        return t[rows], e[rows]

    t, e = iteration_cost(att1, ffn1, head1, shape, s, depth, dim, layers, idle[rows], idle[rows])
    return np.diag(t), np.diag(e)  # one clock for both halves: only the diagonal exists


def _pinned(pred: Predictor, shape: PoolShape, phase: str, rule: ClockRule) -> tuple[int, int] | None:
    """The one (attention, FFN) clock index a fixed or max-clock rule allows; None when the rule scans."""
    top = len(pred.clocks) - 1
    if rule.fixed_mhz is not None:
        fa, ff = rule.fixed_mhz[0 if phase == "prefill" else 1]
        table = pred.clocks.tolist()
        ia = table.index(snap_clock(table, fa, "nearest"))
        return ia, table.index(snap_clock(table, ff, "nearest")) if shape.split else ia
    if rule.max_clock:
        return top, top
    return None


def idle_floor_w(pred: Predictor, shape: PoolShape) -> np.ndarray:
    """The pool's context-idle power (W) over (clock_a, clock_f): what its GPUs draw waiting at those clocks."""
    idle = pred.idle_table
    if shape.split:
        return shape.attention * idle[:, None] + shape.ffn * idle[None, :]
    return np.broadcast_to(shape.gpus * idle[:, None], (len(idle), len(idle)))


OBJECTIVES = ("total", "marginal", "marginal-decode", "idle-aware")


@dataclass(frozen=True)
class DepthTable:
    """One candidate depth's predicted (time, energy) and objective value over the clock pairs it may use."""

    depth: int
    time_s: np.ndarray
    energy_j: np.ndarray
    value: np.ndarray  # what the objective minimises (ClockRule.objective)
    mask: np.ndarray  # the clock pairs the rule allows


@dataclass(frozen=True)
class PointTables:
    """Every candidate of one iteration, before a budget picks one: they depend on the batch and the rule
    only, so a caller that meets the same batch under many budgets (the simulator) can keep them."""

    depths: tuple[DepthTable, ...]
    offset: tuple[int, int]  # the clock table's indices of the tables' (0, 0): a pinned rule's one pair


def point_tables(pred: Predictor, shape: PoolShape, stats: BatchStats, rule: ClockRule,
                 next_prompt_rate_hz: float = 0.0) -> PointTables:
    """The candidates `choose_operating_point` picks from (its docstring)."""
    args = pred.args
    top = len(pred.clocks) - 1
    if shape.split:
        if rule.depths:
            depths = tuple(d for d in rule.depths if d >= 1)
        else:  # MegaScale-Infer: the integer floor from this batch's compute and transfer times
            g = shape.units
            ta, _ = pred.predict("attention", stats.phase, stats.n_tokens / g, stats.ctx_tokens / g, stats.pairs / g,
                                 shard=shape.attention_tp)
            tf, _ = pred.predict("ffn", stats.phase, stats.n_tokens, shard=shape.ffn)
            tc = seam_transfer_s(stats.n_tokens, args.dim, shape.link_bytes_s)
            depths = (megascale_depth(tc, float(max(ta[top], tf[top]))),)
    else:
        depths = (1,)
    if rule.objective not in OBJECTIVES:
        raise ValueError(f"unknown clock objective {rule.objective!r}")
    decode_only = stats.phase == "decode"
    marginal = rule.objective == "marginal" or (rule.objective in ("marginal-decode", "idle-aware") and decode_only)
    waits = rule.objective == "idle-aware" and not decode_only and next_prompt_rate_hz > 0
    floor_w = idle_floor_w(pred, shape) if marginal or waits else 0.0
    # the live rule (`microbatch_depth`): never more microbatches than the group has sequences
    depths = tuple(dict.fromkeys(microbatch_depth(d, stats.group_seqs(shape.units)) for d in depths))
    pin = _pinned(pred, shape, stats.phase, rule)
    if pin is not None:  # one clock pair: a 1x1 table (the same figures as masking the whole one)
        oa, of = pin[0], pin[1] if shape.split else pin[0]
        rows, cols = slice(oa, oa + 1), slice(of, of + 1)
    else:
        oa = of = 0
        rows = cols = slice(None)
    if marginal or waits:
        floor_w = floor_w[rows, cols]  # type: ignore[index]
    out = []
    for d in depths:
        t, e = _tables(pred, shape, stats, d, args.dim, args.n_layers, rows, cols)
        if pin is not None:
            mask = np.ones_like(t, dtype=bool)
        else:
            mask = np.zeros_like(t, dtype=bool)
            if not rule.per_operator or not shape.split:
                np.fill_diagonal(mask, True)
            else:
                mask[:] = True
        # the objective: total energy; energy above the pool's idle floor (marginal); or total energy
        # and the idle pool at these clocks until the next prompt (idle-aware, when the queue empties)
        rate = next_prompt_rate_hz
        v = e + floor_w * np.exp(-rate * t) / rate if waits else e - floor_w * t
        out.append(DepthTable(d, t, e, v, mask))
    return PointTables(tuple(out), (oa, of))


def select_point(pred: Predictor, tables: PointTables, budget_s: float, rule: ClockRule,
                 current: OperatingPoint | None = None) -> OperatingPoint:
    """The least-objective candidate whose time meets `budget_s` (the fastest if none does), with hysteresis."""
    clocks = pred.clocks
    oa, of = tables.offset
    best: OperatingPoint | None = None
    fastest: OperatingPoint | None = None
    keep: OperatingPoint | None = None
    best_v = keep_v = np.inf
    for tab in tables.depths:
        d, t, e, v = tab.depth, tab.time_s, tab.energy_j, tab.value

        def point(i: tuple[Any, ...], feasible: bool, d: int = d, t: np.ndarray = t,
                  e: np.ndarray = e) -> OperatingPoint:
            ga, gf = int(i[0]) + oa, int(i[1]) + of  # the clock table's indices
            return OperatingPoint(d, float(clocks[ga]), float(clocks[gf]), float(t[i]), float(e[i]), feasible,
                                  (ga, gf))

        if t.size == 1:  # one clock pair (a pinned rule): plain floats, as numpy's per-call cost is most of it here
            only = (0, 0)
            t_only, v_only = float(t[only]), float(v[only])
            p_only = point(only, t_only <= budget_s)
            if fastest is None or t_only < fastest.time_s:
                fastest = p_only
            if t_only <= budget_s:
                if best is None or v_only < best_v:
                    best, best_v = p_only, v_only
                if current is not None and current.depth == d and current.index == (oa, of):
                    keep, keep_v = p_only, v_only
            continue
        tm = np.where(tab.mask, t, np.inf)
        i_fast = np.unravel_index(int(np.argmin(tm)), t.shape)
        p_fast = point(i_fast, bool(t[i_fast] <= budget_s))
        if fastest is None or p_fast.time_s < fastest.time_s:
            fastest = p_fast
        ok = tab.mask & (t <= budget_s)
        if ok.any():
            em = np.where(ok, v, np.inf)
            i = np.unravel_index(int(np.argmin(em)), t.shape)
            if best is None or float(v[i]) < best_v:
                best, best_v = point(i, True), float(v[i])
            if current is not None and current.depth == d and current.index[0] >= 0:
                ci = (current.index[0] - oa, current.index[1] - of)
                if 0 <= ci[0] < t.shape[0] and 0 <= ci[1] < t.shape[1] and ok[ci]:
                    keep, keep_v = point(ci, True), float(v[ci])
    if best is None:
        assert fastest is not None
        return fastest
    if keep is not None and keep_v <= best_v + abs(best_v) * rule.hysteresis:
        return keep
    return best


def choose_operating_point(pred: Predictor, shape: PoolShape, stats: BatchStats, budget_s: float, rule: ClockRule,
                           current: OperatingPoint | None = None, next_prompt_rate_hz: float = 0.0) -> OperatingPoint:
    """The least-energy (depth, clock_a, clock_f) whose predicted time meets `budget_s`.

    `next_prompt_rate_hz` (> 0: the pool waits for new prompts once this iteration ends, at this arrival
    rate) prices that wait under the "idle-aware" objective."""
    return select_point(pred, point_tables(pred, shape, stats, rule, next_prompt_rate_hz), budget_s, rule, current)


@dataclass
class SloMargin:
    """Adaptive fraction of the SLO held back for prediction error and queueing."""

    margin: float = 0.15
    lo: float = 0.05
    hi: float = 0.6
    up: float = 0.08
    down: float = 0.02

    def update(self, p90_ms: float | None, slo_ms: float, miss_fraction: float) -> float:
        """Widen on misses beyond 5% of requests (or p90 over the SLO); narrow when comfortably inside (the
        headroom's rule, `headroom.comfortably_inside`) with under 2% missed (a rate the headroom does not see)."""
        if p90_ms is None:
            return self.margin
        if miss_fraction > 0.05 or p90_ms > slo_ms:
            self.margin = min(self.hi, self.margin + self.up)
        elif comfortably_inside(p90_ms, slo_ms) and miss_fraction < 0.02:
            self.margin = max(self.lo, self.margin - self.down)
        return self.margin

    def budget(self, slo_s: float) -> float:
        return slo_s * (1.0 - self.margin)

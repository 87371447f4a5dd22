"""Discrete-event simulator: the same policy objects against emulated GPUs, iteration by iteration.

Virtual time only. Events are arrivals, the end of a pool's iteration, KV transfers landing in the
decode pool, and policy ticks (margin every `tick_s`, provisioning every `window_s`). A pool is one
aggregate of GPUs that iterate together (replicas of a colocated deployment, or the attention and
FFN GPUs of a split pool) with its work spread evenly over them. Each iteration:

1. the batching rule forms the batch (decode sequences + a prefill chunk);
2. the policy picks depth and clocks from the *predictors* under the SLO budget;
3. the iteration's true time and energy come from `operator_cost` of the emulated profile at those
   clocks, combined by the same pipeline formulas (shared.policy.pipeline). A clock change takes
   `switch_delay_s`: that share of the iteration runs at the previous clocks.

Energy: every provisioned GPU is always accounted: busy energy of iterations, context-idle power
between them, `parked_power_w` for GPUs left out of the plan. A power timeline can be recorded.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadgen.sim.arrivals import Arrivals
from loadgen.sim.models import attention_weight_bytes, ffn_weight_bytes, kv_bytes_per_token
from shared.gpu.emulated import GPUProfile, operator_cost
from shared.model.config import ModelArgs
from shared.perf import Predictor, causal_pairs, op_work
from shared.policy import (
    BatchingRule,
    BatchStats,
    ClockRule,
    ClusterSpec,
    OperatingPoint,
    PoolShape,
    SloMargin,
    WindowLoad,
    decode_admit,
    plan_iteration,
    prefill_budget,
    prefill_order,
    provision,
    seq_chunk_cap,
    ttft_budget,
)
from shared.policy.pipeline import iteration_cost
from shared.policy.provision import long_prompt_time

OPERATOR_KEYS = ("prefill-attention", "prefill-ffn", "decode-attention", "decode-ffn")


@dataclass(frozen=True)
class PolicySpec:
    name: str
    split: bool
    clock: ClockRule
    batching: BatchingRule
    dynamic_provisioning: bool = False
    adaptive_margin: bool = True


def policy_spec(name: str) -> PolicySpec:
    md = "marginal-decode"  # AFlex scores decode iterations by energy above the idle floor (ClockRule)
    fixed, adaptive = BatchingRule(adaptive=False), BatchingRule(adaptive=True, order="srpt", prefill_iter_frac=0.3)
    specs = {
        "colocated-max": PolicySpec(name, False, ClockRule(max_clock=True), fixed, adaptive_margin=False),
        "phase-dvfs": PolicySpec(name, False, ClockRule(per_operator=False), fixed),
        # sensitivity only (not a published design): phase-dvfs scoring clocks by energy above the idle floor
        "phase-dvfs-marginal": PolicySpec(name, False, ClockRule(per_operator=False, objective="marginal"), fixed),
        "af-max": PolicySpec(name, True, ClockRule(max_clock=True, depths=()), fixed, adaptive_margin=False),
        "aflex": PolicySpec(name, True, ClockRule(objective=md), adaptive, dynamic_provisioning=True),
        "aflex-no-opfreq": PolicySpec(name, True, ClockRule(per_operator=False, objective=md), adaptive,
                                      dynamic_provisioning=True),
        "aflex-fixed-depth": PolicySpec(name, True, ClockRule(depths=(2,), objective=md), adaptive,
                                        dynamic_provisioning=True),
        "aflex-no-adaptive-batch": PolicySpec(name, True, ClockRule(objective=md), fixed, dynamic_provisioning=True),
    }
    if name not in specs:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(specs)}")
    return specs[name]


POLICIES = ("aflex", "colocated-max", "af-max", "phase-dvfs", "aflex-no-opfreq", "aflex-fixed-depth",
            "aflex-no-adaptive-batch")


@dataclass
class SimConfig:
    gpus: int = 16
    ttft_slo_s: float = 0.4
    tpot_slo_s: float = 0.12
    link_bytes_s: float = 400e9  # A/F seam and TP all-reduce (NVLink); KV transfer P->D uses it too
    switch_delay_s: float | None = None  # None: the profile's clock_switch_delay
    window_s: float = 300.0
    tick_s: float = 30.0
    headroom: float = 1.3
    parked_power: str = "context"  # "context" (warm, weights resident) or "idle" (no context)
    colocated_tp: int | None = None  # None: the smallest TP that holds the model and fits the p90 prompt
    burst_subwindow_s: float = 30.0  # dynamic provisioning sizes for a quantile of these sub-window rates
    burst_quantile: float = 0.9  # 0.5 ~ the window's mean rate; 1.0 its busiest sub-window
    record_power: bool = False
    seed: int = 0


def colocated_tp(args: ModelArgs, memory_bytes: float, gpus: int, pred: Predictor | None = None,
                 p90_prompt: float = 0.0, ttft_budget_s: float = 0.0, link_bytes_s: float = 400e9) -> int:
    """TP of a colocated replica: the smallest that holds the model (with KV room) and, given a
    predictor and a p90 prompt, runs that prompt alone within the TTFT budget at the top clock (else
    the fastest such TP): the operator's choice for the workload, the same rule AFlex's prefill pool
    follows."""
    weights = attention_weight_bytes(args) + ffn_weight_bytes(args)
    fits = [tp for tp in (1, 2, 4, 8) if weights <= 0.75 * tp * memory_bytes and tp <= gpus]
    if not fits:
        raise ValueError(f"{gpus} GPUs cannot hold the model colocated")
    if pred is None or p90_prompt <= 0:
        return fits[0]
    times = {}
    for tp in fits:
        shape = PoolShape(split=False, replicas=gpus // tp, tp=tp, link_bytes_s=link_bytes_s)
        times[tp] = long_prompt_time(pred, shape, p90_prompt)
        if times[tp] <= ttft_budget_s:
            return tp
    return min(times, key=lambda k: times[k])


class Controller:
    """Memoised `plan_iteration` on quantised batch statistics (decisions are deterministic)."""

    def __init__(self, pred: Predictor, rule: ClockRule) -> None:
        self.pred, self.rule = pred, rule
        self.cache: dict[tuple[Any, ...], OperatingPoint] = {}

    @staticmethod
    def _q(x: float, per_octave: int) -> int:
        return round(per_octave * math.log2(x + 1.0))

    @staticmethod
    def _dq(k: int, per_octave: int) -> float:
        return float(2.0 ** (k / per_octave) - 1.0)

    def plan(self, shape: PoolShape, s: BatchStats, budget_s: float, current: OperatingPoint | None) -> OperatingPoint:
        qn, qc = self._q(s.n_tokens, 16), self._q(s.ctx_tokens, 12)
        qp, qs = self._q(s.pairs, 8), self._q(s.n_sample, 16)
        # the single-sequence bound only matters when that sequence is more than one group's share
        big = s.seq_tokens > s.n_tokens / max(1, shape.units)
        sq = (self._q(s.seq_tokens, 16), self._q(s.seq_ctx, 12), self._q(s.seq_pairs, 8)) if big else (0, 0, 0)
        qb = int(budget_s * 400)  # 2.5 ms
        cur = (current.depth, current.index) if current is not None else None
        key = (shape, s.phase, qn, qc, qp, qs, sq, qb, cur)
        op = self.cache.get(key)
        if op is None:
            seq = (self._dq(sq[0], 16), self._dq(sq[1], 12), self._dq(sq[2], 8)) if big else (0.0, 0.0, 0.0)
            rep = BatchStats(s.phase, self._dq(qn, 16), self._dq(qc, 12), self._dq(qp, 8), self._dq(qs, 16), *seq)
            op = plan_iteration(self.pred, shape, rep, qb / 400.0, self.rule, current)
            if len(self.cache) > 200_000:
                self.cache.clear()
            self.cache[key] = op
        return op


@dataclass
class Pool:
    mode: str  # "mixed", "prefill", "decode"
    shape: PoolShape
    queue: deque[list[int]] = field(default_factory=deque)  # [rid, remaining prompt tokens]
    queued_tokens: int = 0
    heap: list[tuple[int, int]] = field(default_factory=list)  # (finish iteration, rid)
    n_run: int = 0
    ctx_sum: float = 0.0
    iters: int = 0
    busy_until: float = -1.0
    idle_since: float = 0.0
    op: OperatingPoint | None = None
    pending: tuple[list[tuple[int, int]], int] | None = None  # prefill chunk [(rid, q)], decode tokens
    waiting: deque[int] = field(default_factory=deque)  # decode admission wait list


class Simulation:
    def __init__(self, profile: GPUProfile, args: ModelArgs, arrivals: Arrivals, policy: PolicySpec,
                 config: SimConfig, predictor: Predictor) -> None:
        self.p, self.args, self.arr, self.pol, self.cfg = profile, args, arrivals, policy, config
        self.pred = predictor
        self.ctrl = Controller(predictor, policy.clock)
        self.switch_delay = profile.clock_switch_delay_s if config.switch_delay_s is None else config.switch_delay_s
        self.idle_w = profile.context_idle_power_w
        self.parked_w = profile.context_idle_power_w if config.parked_power == "context" else profile.idle_power_w
        self.margin_ttft, self.margin_tpot = SloMargin(), SloMargin()
        self.kv_tok = kv_bytes_per_token(args)
        self.mem = 80e9
        n = len(arrivals)
        self.first = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.energy_j = 0.0
        self.busy_gpu_s = 0.0
        self.clock_time = {k: 0.0 for k in OPERATOR_KEYS}  # GPU-seconds busy per operator
        self.clock_weighted = {k: 0.0 for k in OPERATOR_KEYS}
        self.timeline: list[tuple[float, float, float]] = []
        self.clock_trace: list[tuple[float, str, float, float, int]] = []
        self.plans: list[tuple[float, dict[str, Any]]] = []
        self.spec = ClusterSpec(
            gpus=config.gpus, gpu_memory_bytes=self.mem, attention_weight_bytes=attention_weight_bytes(args),
            ffn_weight_bytes=ffn_weight_bytes(args), kv_bytes_per_token=self.kv_tok,
            link_bytes_s=config.link_bytes_s, ttft_budget_s=config.ttft_slo_s * 0.85,
            tpot_budget_s=config.tpot_slo_s * 0.85, parked_power_w=self.parked_w)
        self.pools: dict[str, Pool] = {}
        self.parked = 0
        self.planned_rate = 0.0
        self._parked_since = 0.0

    # -- energy -------------------------------------------------------------------------------
    def _add(self, t0: float, t1: float, watts: float) -> None:
        if t1 <= t0:
            return
        self.energy_j += watts * (t1 - t0)
        if self.cfg.record_power:
            self.timeline.append((t0, t1, watts))

    def _add_energy(self, t0: float, t1: float, joules: float) -> None:
        if t1 > t0:
            self._add(t0, t1, joules / (t1 - t0))
        else:
            self.energy_j += joules

    def _set_parked(self, now: float, parked: int) -> None:
        self._add(self._parked_since, now, self.parked * self.parked_w)
        self.parked, self._parked_since = parked, now

    # -- provisioning -------------------------------------------------------------------------
    def _load(self, t0: float, t1: float, burst: bool = False) -> WindowLoad:
        """The load of [t0, t1): mean rate, or with `burst` the `burst_quantile` of its sub-window rates
        (the global controller provisions for the bursts it saw, not their average)."""
        a = self.arr
        t0 = max(0.0, t0)
        i0, i1 = np.searchsorted(a.time_s, [t0, t1])
        k = i1 - i0
        if k == 0:
            mp = float(np.mean(a.prompt)) if len(a) else 1.0
            return WindowLoad(0.05, mp, float(np.mean(a.output)) if len(a) else 1.0)
        rate = k / max(t1 - t0, 1e-9)
        sub = self.cfg.burst_subwindow_s
        if burst and t1 - t0 > 1.5 * sub:
            edges = np.arange(t0, t1 + 1e-9, sub)
            counts = np.diff(np.searchsorted(a.time_s, edges))
            rate = max(rate, float(np.quantile(counts / sub, self.cfg.burst_quantile)))
        prompts = a.prompt[i0:i1]
        return WindowLoad(rate, float(np.mean(prompts)), float(np.mean(a.output[i0:i1])),
                          float(np.percentile(prompts, 90)))

    def _apply_plan(self, now: float, shapes: dict[str, PoolShape], parked: int) -> None:
        for name, shape in shapes.items():
            if name not in self.pools:
                self.pools[name] = Pool(mode=name, shape=shape, idle_since=now)
            else:
                pool = self.pools[name]
                if pool.busy_until <= now:  # idle: close its idle stretch at the old size
                    self._add(pool.idle_since, now, pool.shape.gpus * self.idle_w)
                    pool.idle_since = now
                pool.shape = shape
        self._set_parked(now, parked)
        self.plans.append((now, {k: [v.attention, v.ffn, v.attention_tp] if v.split else [v.replicas, v.tp]
                                 for k, v in shapes.items()} | {"parked": parked}))

    def _provision(self, now: float, load: WindowLoad, scale_up_only: bool = False) -> None:
        n = self.cfg.gpus
        if not self.pol.split:
            tp = self.cfg.colocated_tp or colocated_tp(
                self.args, self.mem, n, self.pred, float(np.percentile(self.arr.prompt, 90)) if len(self.arr) else 0,
                self.spec.ttft_budget_s, self.cfg.link_bytes_s)
            if not self.pools:
                shape = PoolShape(split=False, replicas=n // tp, tp=tp, link_bytes_s=self.cfg.link_bytes_s)
                self._apply_plan(now, {"mixed": shape}, n - shape.gpus)
            return
        if self.pools and not self.pol.dynamic_provisioning:
            return
        if self.pol.dynamic_provisioning:
            plan = provision(self.pred, load, self.spec, self.pol.clock, headroom=self.cfg.headroom)
        else:  # static at the trace's peak 5-minute load, every GPU used (MegaScale-Infer plan search)
            plan = provision(self.pred, load, self.spec, self.pol.clock, headroom=self.cfg.headroom, use_all=True)
        shapes = {k: v for k, v in (("prefill", plan.prefill), ("decode", plan.decode), ("mixed", plan.mixed))
                  if v is not None}
        if scale_up_only and all(shapes[k].gpus <= self.pools[k].shape.gpus for k in shapes if k in self.pools):
            return
        if scale_up_only:
            shapes = {k: (v if v.gpus >= self.pools[k].shape.gpus else self.pools[k].shape) for k, v in shapes.items()}
            used = sum(v.gpus for v in shapes.values())
            if used > n:
                return
            self._apply_plan(now, shapes, n - used)
        else:
            self._apply_plan(now, shapes, plan.parked)
        self.planned_rate = load.rate_rps

    def _peak_load(self) -> WindowLoad:
        a = self.arr
        end = float(a.time_s[-1]) if len(a) else 1.0
        best = self._load(0, min(end + 1e-6, self.cfg.window_s))
        t = 0.0
        while t < end:
            w = self._load(t, t + self.cfg.window_s)
            if w.rate_rps > best.rate_rps:
                best = w
            t += self.cfg.window_s
        return best

    # -- iterations ---------------------------------------------------------------------------
    def _truth(self, shape: PoolShape, s: BatchStats, depth: int, fa: float, ff: float) -> tuple[float, float]:
        """True (time, energy) from the emulated GPU at the chosen clocks (the same pipeline formulas)."""
        a, p = self.args, self.p

        def att(n: float, ctx: float, pairs: float, shard: int) -> tuple[np.ndarray, np.ndarray]:
            c = operator_cost(p, op_work(a, "attention", s.phase, n, ctx, pairs, shard), fa)
            return np.array(c.time_s), np.array(c.energy_j)

        def ffn(n: float, shard: int) -> tuple[np.ndarray, np.ndarray]:
            c = operator_cost(p, op_work(a, "ffn", s.phase, n, 0, 0, shard), ff if shape.split else fa)
            return np.array(c.time_s), np.array(c.energy_j)

        def head(n: float, shard: int) -> tuple[np.ndarray, np.ndarray]:
            c = operator_cost(p, op_work(a, "lm_head", s.phase, n, 0, 0, shard), fa)
            return np.array(c.time_s), np.array(c.energy_j)

        t, e = iteration_cost(att, ffn, head, shape, s, depth, a.dim, a.n_layers, self.idle_w)
        return float(t), float(e)

    def _kv_capacity(self, pool: Pool) -> float:
        sh = pool.shape
        if sh.split:
            return self.spec.kv_capacity_tokens(sh.attention)
        w = attention_weight_bytes(self.args) + ffn_weight_bytes(self.args)
        return sh.replicas * (0.9 * sh.tp * self.mem - w) / self.kv_tok

    def _admit(self, pool: Pool, now: float) -> None:
        cap = self._kv_capacity(pool)
        while pool.waiting:
            rid = pool.waiting[0]
            ctx = float(self.arr.prompt[rid] + 1)
            need = float(self.arr.prompt[rid] + self.arr.output[rid])
            if not decode_admit(self.pol.batching, pool.n_run, pool.ctx_sum + pool.n_run, cap, need) and pool.n_run:
                break
            pool.waiting.popleft()
            pool.n_run += 1
            pool.ctx_sum += ctx
            heapq.heappush(pool.heap, (pool.iters + int(self.arr.output[rid]) - 1, rid))

    def _start(self, pool: Pool, now: float) -> None:
        if pool.mode != "prefill":
            self._admit(pool, now)
        n_dec = pool.n_run if pool.mode != "prefill" else 0
        has_prefill = pool.mode != "decode" and pool.queued_tokens > 0
        if n_dec == 0 and not has_prefill:
            return
        tpot_b = self.margin_tpot.budget(self.cfg.tpot_slo_s)
        ttft_margin = self.margin_ttft.budget(self.cfg.ttft_slo_s)
        chunk: list[tuple[int, int]] = []
        n_pre = ctx_pre = pairs_pre = 0.0
        seq: tuple[float, float, float] = (0.0, 0.0, 0.0)  # the largest single sequence chunk
        n_done_pre = 0
        budget = tpot_b if n_dec else math.inf
        if has_prefill:
            shape = pool.shape
            if self.pol.batching.order != "fcfs" and len(pool.queue) > 1:
                items = list(pool.queue)
                order = prefill_order(self.pol.batching, now, [float(self.arr.time_s[r]) for r, _ in items],
                                      [float(rem) for _, rem in items])
                pool.queue = deque(items[k] for k in order)

            head_rem = pool.queue[0][1]

            def time_at_max(tokens: int) -> float:
                q1 = min(tokens, head_rem)
                st = BatchStats("prefill", n_dec + tokens, pool.ctx_sum + n_dec + tokens, pool.ctx_sum + n_dec + tokens
                                * tokens / 2, n_dec + 1, q1, q1, causal_pairs(q1, q1))
                return plan_iteration(self.pred, shape, st, 0.0, ClockRule(max_clock=True, depths=(1,))).time_s

            rule = self.pol.batching
            iter_s = rule.prefill_iter_frac * self.cfg.ttft_slo_s
            take = prefill_budget(rule, pool.queued_tokens, n_dec, time_at_max if n_dec or iter_s > 0 else None,
                                  tpot_b, units=shape.units, prefill_iter_s=iter_s)
            cap = seq_chunk_cap(self.pol.batching, take)
            left = take
            deadlines: list[float] = []
            ahead: list[float] = []
            acc = 0.0
            for rid, rem in pool.queue:
                if len(deadlines) >= 32:
                    break
                acc += rem
                deadlines.append(float(self.arr.time_s[rid]) + ttft_margin)
                ahead.append(acc)
            budget = min(budget, ttft_budget(now, deadlines, ahead, max(take, 1)))
            for entry in pool.queue:
                if left <= 0:
                    break
                rid, rem = entry
                q = min(rem, left, cap)
                done = int(self.arr.prompt[rid]) - rem
                c = done + q
                n_pre += q
                ctx_pre += c
                pr = causal_pairs(q, c)
                pairs_pre += pr
                if q > seq[0]:
                    seq = (q, c, pr)
                chunk.append((rid, q))
                left -= q
                if q == rem:
                    n_done_pre += 1
        phase = "prefill" if n_pre > 0 else "decode"
        ctx_dec = pool.ctx_sum + n_dec
        stats = BatchStats(phase, n_dec + n_pre, ctx_dec + ctx_pre, ctx_dec + pairs_pre, n_dec + n_done_pre, *seq)
        op = self.ctrl.plan(pool.shape, stats, budget, pool.op)
        t, e = self._truth(pool.shape, stats, op.depth, op.clock_attention, op.clock_ffn)
        prev = pool.op
        if prev is not None and (prev.clock_attention, prev.clock_ffn) != (op.clock_attention, op.clock_ffn) \
                and self.switch_delay > 0:
            t_old, e_old = self._truth(pool.shape, stats, op.depth, prev.clock_attention, prev.clock_ffn)
            phi = min(1.0, self.switch_delay / max(t, 1e-9))
            t, e = phi * t_old + (1 - phi) * t, phi * e_old + (1 - phi) * e
        # energy: the idle stretch before, then the iteration
        self._add(pool.idle_since, now, pool.shape.gpus * self.idle_w)
        self._add_energy(now, now + t, e)
        pool.op = op
        pool.busy_until = now + t
        pool.pending = (chunk, n_dec)
        gpu_s = pool.shape.gpus * t
        self.busy_gpu_s += gpu_s
        if pool.shape.split:
            a_s = pool.shape.attention * t
            f_s = pool.shape.ffn * t
        else:
            a_s = f_s = gpu_s / 2
        self.clock_time[f"{phase}-attention"] += a_s
        self.clock_weighted[f"{phase}-attention"] += a_s * op.clock_attention
        self.clock_time[f"{phase}-ffn"] += f_s
        self.clock_weighted[f"{phase}-ffn"] += f_s * op.clock_ffn
        if self.cfg.record_power and (not self.clock_trace or now - self.clock_trace[-1][0] > 1.0):
            self.clock_trace.append((now, phase, op.clock_attention, op.clock_ffn, op.depth))

    def _finish_iteration(self, pool: Pool, now: float) -> list[int]:
        """Apply a finished iteration; returns requests whose prefill completed (for the decode pool)."""
        assert pool.pending is not None
        chunk, n_dec = pool.pending
        pool.pending = None
        pool.idle_since = now
        completed: list[int] = []
        if n_dec:
            pool.iters += 1
            pool.ctx_sum += pool.n_run
            while pool.heap and pool.heap[0][0] <= pool.iters:
                _, rid = heapq.heappop(pool.heap)
                self.finish[rid] = now
                pool.n_run -= 1
                pool.ctx_sum -= float(self.arr.prompt[rid] + self.arr.output[rid])
        finished_prefill = 0
        for idx, (rid, q) in enumerate(chunk):  # the chunk is a prefix of the queue, in order
            entry = pool.queue[idx]
            assert entry[0] == rid
            entry[1] -= q
            pool.queued_tokens -= q
            if entry[1] == 0:
                finished_prefill += 1
                self.first[rid] = now
                if self.arr.output[rid] <= 1:
                    self.finish[rid] = now
                else:
                    completed.append(rid)
        if finished_prefill:
            pool.queue = deque(e for e in pool.queue if e[1] > 0)
        return completed

    # -- main loop ----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        a = self.arr
        n = len(a)
        end_arrivals = float(a.time_s[-1]) if n else 0.0
        if self.pol.split and not self.pol.dynamic_provisioning:
            self._provision(0.0, self._peak_load())
        else:
            self._provision(0.0, self._load(0.0, min(60.0, end_arrivals + 1e-6), burst=True))
        kv_heap: list[tuple[float, int]] = []
        i = 0
        next_tick = self.cfg.tick_s
        next_window = self.cfg.window_s
        last_tick = 0.0
        pre_name = "prefill" if "prefill" in self.pools else "mixed"
        dec_name = "decode" if "decode" in self.pools else "mixed"
        now = 0.0
        while True:
            busy = [p.busy_until for p in self.pools.values() if p.pending is not None]
            t_pool = min(busy) if busy else math.inf
            t_arr = float(a.time_s[i]) if i < n else math.inf
            t_kv = kv_heap[0][0] if kv_heap else math.inf
            t_next = min(t_pool, t_arr, t_kv)
            if t_next == math.inf:
                break
            if next_tick <= t_next:
                now = next_tick
                self._tick(now, last_tick)
                last_tick = now
                if now >= next_window:
                    if self.pol.dynamic_provisioning:
                        self._provision(now, self._load(now - self.cfg.window_s, now, burst=True))
                    next_window += self.cfg.window_s
                elif self.pol.dynamic_provisioning:
                    recent = self._load(now - self.cfg.tick_s, now)
                    if recent.rate_rps > 1.2 * self.planned_rate:
                        self._provision(now, recent, scale_up_only=True)
                next_tick += self.cfg.tick_s
                continue
            now = t_next
            if t_pool == now:
                for pool in self.pools.values():
                    if pool.pending is not None and pool.busy_until <= now:
                        done = self._finish_iteration(pool, now)
                        if pool.mode == "mixed":
                            pool.waiting.extend(done)
                        else:
                            for rid in done:
                                kv_s = float(a.prompt[rid]) * self.kv_tok / self.cfg.link_bytes_s
                                heapq.heappush(kv_heap, (now + kv_s, rid))
            while kv_heap and kv_heap[0][0] <= now:
                _, rid = heapq.heappop(kv_heap)
                self.pools[dec_name].waiting.append(rid)
            while i < n and a.time_s[i] <= now:
                pool = self.pools[pre_name]
                pool.queue.append([i, int(a.prompt[i])])
                pool.queued_tokens += int(a.prompt[i])
                i += 1
            for pool in self.pools.values():
                if pool.pending is None:
                    self._start(pool, now)
        # close the books
        for pool in self.pools.values():
            self._add(pool.idle_since, now, pool.shape.gpus * self.idle_w)
        self._set_parked(now, self.parked)
        self.makespan = now
        return self.results()

    def _tick(self, now: float, since: float) -> None:
        if not self.pol.adaptive_margin:
            return
        a = self.arr
        sel = (self.first >= since) & (self.first < now)
        if sel.any():
            ttft = (self.first[sel] - a.time_s[sel]) * 1e3
            self.margin_ttft.update(float(np.percentile(ttft, 90)), self.cfg.ttft_slo_s * 1e3,
                                    float(np.mean(ttft > self.cfg.ttft_slo_s * 1e3)))
        sel = (self.finish >= since) & (self.finish < now) & (a.output > 1)
        if sel.any():
            tpot = (self.finish[sel] - self.first[sel]) / (a.output[sel] - 1) * 1e3
            self.margin_tpot.update(float(np.percentile(tpot, 90)), self.cfg.tpot_slo_s * 1e3,
                                    float(np.mean(tpot > self.cfg.tpot_slo_s * 1e3)))

    def results(self) -> dict[str, Any]:
        a = self.arr
        ttft = (self.first - a.time_s) * 1e3
        multi = a.output > 1
        tpot = np.where(multi, (self.finish - self.first) / np.maximum(a.output - 1, 1) * 1e3, 0.0)
        tokens = float(a.prompt.sum() + a.output.sum())
        ok = (ttft <= self.cfg.ttft_slo_s * 1e3) & (tpot <= self.cfg.tpot_slo_s * 1e3)

        def pct(x: np.ndarray, q: float) -> float | None:
            return float(np.percentile(x, q)) if len(x) else None

        return {
            "requests": len(a),
            "finished": int(np.sum(~np.isnan(self.finish))),
            "tokens": tokens,
            "energy_j": self.energy_j,
            "energy_per_token_j": self.energy_j / tokens if tokens else None,
            "mean_power_w": self.energy_j / self.makespan if self.makespan > 0 else None,
            "makespan_s": self.makespan,
            "p50_ttft_ms": pct(ttft, 50), "p90_ttft_ms": pct(ttft, 90), "p99_ttft_ms": pct(ttft, 99),
            "p50_tpot_ms": pct(tpot[multi], 50), "p90_tpot_ms": pct(tpot[multi], 90),
            "p99_tpot_ms": pct(tpot[multi], 99),
            "slo_attainment": float(np.mean(ok)) if len(a) else None,
            "mean_clock_mhz": {k: (self.clock_weighted[k] / self.clock_time[k] if self.clock_time[k] else None)
                               for k in OPERATOR_KEYS},
            "gpus": self.cfg.gpus,
            "plans": [{"t_s": t, **p} for t, p in self.plans],
            "final_margin": {"ttft": self.margin_ttft.margin, "tpot": self.margin_tpot.margin},
        }

"""Discrete-event simulator: the same policy objects against emulated GPUs, iteration by iteration.

Virtual time only. The batching rule forms each iteration, the policy picks depth and clocks from
the *predictors*, and the iteration's true time and energy come from the emulated profile at those
clocks through the same pipeline formulas (shared.policy.pipeline); every GPU is accounted for the
whole run (ledger.py). Events and accounting in full: docs/architecture.md, "The simulator".
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Any

import numpy as np

from loadgen.sim.arrivals import Arrivals, with_prefix_reuse
from loadgen.sim.config import ACCOUNTINGS, SimConfig, planner_parked_w
from loadgen.sim.controller import Controller
from loadgen.sim.fleet import Fleet, Pool, backlog, pool_mode, replica_pools
from loadgen.sim.ledger import EnergyLedger
from loadgen.sim.models import attention_weight_bytes, ffn_weight_bytes, kv_bytes_per_token
from loadgen.sim.planning import SimPlanner
from loadgen.sim.policies import PolicySpec
from loadgen.sim.results import sim_results
from loadgen.sim.slo_window import p90_ttft_ms, stretch_tpot_met
from loadgen.sim.truth import IterationTruth
from shared.gpu.emulated import GPUProfile
from shared.kinds import ParkedState
from shared.model.config import ModelArgs
from shared.perf import Predictor, causal_pairs
from shared.policy import (
    BatchStats,
    ClusterSpec,
    PoolShape,
    PrefillQuery,
    SloMargin,
    WindowLoad,
    WorkItem,
    decode_admit,
    form_iteration,
    prefill_order,
    seq_chunk_cap,
)
from shared.policy.decode_slack import DecodeSlack, iteration_budget_s
from shared.policy.footprint import plan_power_w
from shared.policy.headroom import AdaptiveHeadroom
from shared.policy.parking_rule import model_parking_state, parked_power_w
from shared.policy.pool_sizing import Plan, pools_kind
from shared.policy.power_correction import PowerCorrection
from shared.policy.prefill_cap import AT_MAX, prefill_cap, queue_ttft_budget

OPERATOR_KEYS = ("prefill-attention", "prefill-ffn", "decode-attention", "decode-ffn")
MIXED_MODES = ("mixed", "colocated")  # pools that serve prefill and decode
PROMPT_MODES = ("prefill", *MIXED_MODES)  # in the order a plan's entry pool is looked up
DECODE_MODES = ("decode", *MIXED_MODES)


class Simulation:
    def __init__(self, profile: GPUProfile, args: ModelArgs, arrivals: Arrivals, policy: PolicySpec,
                 config: SimConfig, predictor: Predictor) -> None:
        if config.prefix_reuse is not None:
            arrivals = with_prefix_reuse(arrivals, config.prefix_reuse)
        self.p, self.args, self.arr, self.pol, self.cfg = profile, args, arrivals, policy, config
        self.truth = IterationTruth(profile, args)
        self.pred = predictor
        self.ctrl = Controller(predictor, policy.clock)
        self.switch_delay = profile.clock_switch_delay_s if config.switch_delay_s is None else config.switch_delay_s
        if config.accounting not in ACCOUNTINGS:
            raise ValueError(f"unknown accounting {config.accounting!r}; known: {', '.join(ACCOUNTINGS)}")
        self.margin_ttft, self.margin_tpot = SloMargin(), SloMargin()
        self.kv_tok = kv_bytes_per_token(args)
        self.mem = profile.memory_bytes  # the profile's device (80 GB on the A800)
        n = len(arrivals)
        self.first = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.clock_time = {k: 0.0 for k in OPERATOR_KEYS}  # GPU-seconds busy per operator
        self.clock_weighted = {k: 0.0 for k in OPERATOR_KEYS}
        self.clock_trace: list[tuple[float, str, float, float, int]] = []
        self.plans: list[tuple[float, dict[str, Any]]] = []
        self.weights = {"attention": attention_weight_bytes(args), "ffn": ffn_weight_bytes(args)}
        # parking: one rule for every policy; a GPU out of the plan is expected to stay out a window.
        # fixed-pool accounting: no GPU leaves its context, so parked GPUs idle warm at the lowest clock
        self.parking: ParkedState = "warm" if config.accounting == "fixed-pool" else model_parking_state(
            config.parking, profile, args, config.window_s)
        self.parked_w = parked_power_w(self.parking, profile)
        self.spec = ClusterSpec.for_model(
            args, config.gpus, ttft_slo_s=config.ttft_slo_s, tpot_slo_s=config.tpot_slo_s,
            link_bytes_s=config.link_bytes_s, parked_power_w=planner_parked_w(config.accounting, self.parked_w),
            gpu_memory_bytes=self.mem, node_gpus=config.node_gpus, inter_node_bytes_s=config.inter_node_bytes_s)
        # a scaling planner corrects its headroom by the TTFT it saw (the live scheduler's rule, shared machinery)
        self.headroom = AdaptiveHeadroom(config.headroom) if policy.scaling else None
        self.planner = SimPlanner(policy, self.spec, predictor, arrivals, config.window_s, config.headroom,
                                  config.burst_subwindow_s, config.burst_quantile, config.colocated_tp)
        self.ledger = EnergyLedger(active_from_s=float(arrivals.time_s[0]) if n else 0.0, record=config.record_power)
        self.fleet = Fleet(profile, config.gpus, self.switch_delay, self.weights, self.parking, self.ledger)
        self.pools, self.rejoins, self.reshards = self.fleet.pools, self.fleet.rejoins, self.fleet.reshards
        self.planned_rate = 0.0
        self.plan_names: tuple[str, ...] = ()  # the pools of the latest plan (each colocated replica its own)
        self.plan_shapes: dict[str, PoolShape] = {}  # the latest plan, as planned
        # AFlex ranks its plan kinds by predicted power corrected by what each kind's plans were charged
        self.correction = PowerCorrection(config.window_s) if policy.scaling and len(policy.kinds) > 1 else None
        self.planner.correction = self.correction
        self._stretch: tuple[float, str, Plan | None, float] = (0.0, "", None, 0.0)  # since, kind, plan, J

    # -- provisioning -------------------------------------------------------------------------
    def _apply_plan(self, now: float, shapes: dict[str, PoolShape]) -> None:
        pools = replica_pools(shapes)
        self.fleet.apply(now, pools)
        self.plan_shapes, self.plan_names = dict(shapes), tuple(pools)
        for pool in self.pools.values():
            if pool.retiring and not pool.shape.gpus and (pool.queue or pool.waiting):
                self._hand_over(pool, now)
        if self.pol.window_clocks:
            for name, shape in shapes.items():
                rule = self.planner.window_rule(name, shape)
                for pool_name in pools:
                    if pool_mode(pool_name) == name:
                        self.pools[pool_name].rule = rule
        kind = pools_kind(shapes)
        if self.correction is not None:  # a plan merged with the pools in force is not the one priced
            plan = self.planner.last_plan
            known = plan is not None and plan.pools() == shapes
            self._stretch = (now, kind, plan if known else None, self._books_j(now))
        self.plans.append((now, {"kind": kind} | {
            k: [v.attention, v.ffn, v.attention_tp] if v.split else [v.replicas, v.tp] for k, v in shapes.items()}
            | {"parked": self.cfg.gpus - sum(sh.gpus for sh in shapes.values())}
            | ({"weighed": dict(self.planner.last_weighed)} if self.planner.last_weighed else {})))

    def _books_j(self, now: float) -> float:
        """The energy charged up to `now` in the accounting the planner prices (idle stretches and groups closed)."""
        for pool in self.pools.values():
            if pool.pending is None:
                self.fleet.close_idle(pool, now)
        self.ledger.close(now)
        return self.ledger.active_j if self.cfg.accounting == "active" else self.ledger.cluster_j

    def _observe_power(self, now: float) -> None:
        """Fold what the plan in force drew since it began (or since the last look), against what the pool
        models price it at for the load that came meanwhile, into its kind's factor."""
        assert self.correction is not None
        since, kind, plan, j0 = self._stretch
        j = self._books_j(now)
        start = max(since, self.ledger.active_from_s) if self.cfg.accounting == "active" else since
        if plan is None or now <= start:
            return
        predicted_w = plan_power_w(self.pred, plan, self.planner.load(start, now), self.spec, self.pol.clock)
        p90 = self._p90_ttft_ms(start, now)
        met = p90 is None or p90 <= self.cfg.ttft_slo_s * 1e3
        met_tpot = stretch_tpot_met(self.arr.time_s, self.first, self.finish, self.arr.output, start, now,
                                    self.cfg.tpot_slo_s)
        self.correction.judged(kind, met_tpot, self.planner.load(start, now, True).rate_rps, now - start,
                               self.planned_rate)  # at the burst load that came
        if predicted_w is None or self.correction.observe(kind, predicted_w, j - j0, now - start, met):
            self._stretch = (now, kind, plan, j)  # an overload's stretch is left out

    def _p90_ttft_ms(self, t0: float, t1: float) -> float | None:
        return p90_ttft_ms(self.arr.time_s, self.first, t0, t1)

    def _provision(self, now: float, load: WindowLoad, scale_up_only: bool = False) -> None:
        # a tick between windows grows the pools of the kind in force; only a window changes kind. A tick that
        # left colocated replicas for P/D pools in a surge (conv-Qwen3 x2) drained all 16 GPUs into split pools
        # whose prefill model had never been checked: P90 TTFT 32.8 s over the hour, 375 ms without it
        if self.correction is not None:
            self._observe_power(now)
        if self.headroom is not None:  # the P90 TTFT of the window before each plan corrects its headroom
            p90 = self._p90_ttft_ms(now - self.cfg.window_s, now)
            self.planner.headroom = self.headroom.update(p90, self.cfg.ttft_slo_s * 1e3)
        shapes = self.planner.window(load, same_kind=scale_up_only)
        if scale_up_only:
            if set(shapes) != set(self.plan_shapes):
                return
            current = self.plan_shapes
            if all(shapes[k].gpus <= current[k].gpus for k in shapes):
                return
            shapes = {k: (v if v.gpus >= current[k].gpus else current[k]) for k, v in shapes.items()}
            if sum(v.gpus for v in shapes.values()) > self.cfg.gpus:
                return
        self._apply_plan(now, shapes)
        self.planned_rate = load.rate_rps

    # -- iterations ---------------------------------------------------------------------------
    def _admit(self, pool: Pool, now: float) -> None:
        cap = self.spec.pool_kv_capacity_tokens(pool.shape)
        while pool.waiting:
            rid = pool.waiting[0]
            ctx = float(self.arr.prompt[rid] + 1)
            need = float(self.arr.prompt[rid] + self.arr.output[rid])
            if not decode_admit(self.pol.batching, pool.n_run, pool.ctx_sum + pool.n_run, cap, need,
                                instances=pool.shape.units) and pool.n_run:
                break
            pool.waiting.popleft()
            pool.n_run += 1
            pool.ctx_sum += ctx
            heapq.heappush(pool.heap, (pool.iters + int(self.arr.output[rid]) - 1, rid))
            if self.pol.batching.decode_slack:
                if pool.slack is None:
                    pool.slack = DecodeSlack(self.spec.tpot_budget_s)
                pool.slack.admit(rid, float(self.first[rid]), pool.iters)

    def _start(self, pool: Pool, now: float) -> None:
        if pool.shape.gpus == 0:  # not grown yet (its GPUs are on their way), or retired
            return
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
        if n_dec and pool.slack is not None:  # the running requests' banked TPOT
            budget = iteration_budget_s(tpot_b, pool.slack.least_allowance_s(now, pool.iters), self.cfg.ttft_slo_s)
        if has_prefill:
            shape = pool.shape
            if self.pol.batching.order != "fcfs" and len(pool.queue) > 1:
                items = list(pool.queue)
                order = prefill_order(self.pol.batching, now, [float(self.arr.time_s[r]) for r, _ in items],
                                      [float(rem) for _, rem in items])
                pool.queue = deque(items[k] for k in order)

            head_rem = pool.queue[0][1]

            oldest_s = min(float(self.arr.time_s[rid]) for rid, _ in pool.queue)
            query = PrefillQuery(queued_tokens=pool.queued_tokens, n_decode=n_dec, decode_ctx_tokens=pool.ctx_sum,
                                 head_tokens=head_rem, oldest_wait_s=now - oldest_s)
            take = prefill_cap(self.pol.batching, query, lambda st: self.ctrl.plan(shape, st, 0.0, None, AT_MAX).time_s,
                               tpot_budget_s=tpot_b, ttft_slo_s=self.cfg.ttft_slo_s, units=shape.units)
            cap = seq_chunk_cap(self.pol.batching, take)
            queue = ((float(self.arr.time_s[rid]), rem) for rid, rem in pool.queue)
            budget = min(budget, queue_ttft_budget(now, queue, ttft_margin, max(take, 1)))
            # the scheduler's and the engine's iteration former: q = min(rem, left, cap) in serving order
            form = form_iteration((), [WorkItem(rid, rem) for rid, rem in pool.queue], token_budget=take, seq_cap=cap)
            for feed in form.feeds:  # a prefix of pool.queue
                rid, rem, q = feed.key, feed.item.remaining_tokens, feed.n_tokens
                done = int(self.arr.prompt[rid]) - rem
                c = done + q
                n_pre += q
                ctx_pre += c
                pr = causal_pairs(q, c)
                pairs_pre += pr
                if q > seq[0]:
                    seq = (q, c, pr)
                chunk.append((rid, q))
                if feed.completes:
                    n_done_pre += 1
        phase = "prefill" if n_pre > 0 else "decode"
        ctx_dec = pool.ctx_sum + n_dec
        stats = BatchStats(phase, n_dec + n_pre, ctx_dec + ctx_pre, ctx_dec + pairs_pre, n_dec + n_done_pre, *seq,
                           n_seqs=n_dec + len(chunk))
        # the pool waits for the next prompt after an iteration that empties its queue with no decode beside it
        drains = n_pre > 0 and n_dec == 0 and n_done_pre == len(pool.queue)
        frac = self.pol.batching.prefill_iter_frac
        if drains and frac > 0:  # a prompt that comes meanwhile waits for it: as long as the rule sized it for
            budget = min(budget, frac * ttft_margin)
        op = self.ctrl.plan(pool.shape, stats, budget, pool.op, pool.rule,
                            self._recent_rate_hz(now) if drains else 0.0)
        t, e = self.truth.cost(pool.shape, stats, op.depth, op.clock_attention, op.clock_ffn)
        prev = pool.op
        if prev is not None and (prev.clock_attention, prev.clock_ffn) != (op.clock_attention, op.clock_ffn) \
                and self.switch_delay > 0:
            t_old, e_old = self.truth.cost(pool.shape, stats, op.depth, prev.clock_attention, prev.clock_ffn)
            phi = min(1.0, self.switch_delay / max(t, 1e-9))
            t, e = phi * t_old + (1 - phi) * t, phi * e_old + (1 - phi) * e
        # energy: the idle stretch before (at the clocks it waited at), then the iteration
        self.fleet.close_idle(pool, now)
        self.fleet.charge(pool, now, now + t, e)
        pool.op = op
        pool.busy_until = now + t
        pool.pending = (chunk, n_dec)
        if pool.shape.split:
            a_s = pool.shape.attention * t
            f_s = pool.shape.ffn * t
        else:
            a_s = f_s = pool.shape.gpus * t / 2
        self.clock_time[f"{phase}-attention"] += a_s
        self.clock_weighted[f"{phase}-attention"] += a_s * op.clock_attention
        self.clock_time[f"{phase}-ffn"] += f_s
        self.clock_weighted[f"{phase}-ffn"] += f_s * op.clock_ffn
        if self.cfg.record_power and (not self.clock_trace or now - self.clock_trace[-1][0] > 1.0):
            self.clock_trace.append((now, phase, op.clock_attention, op.clock_ffn, op.depth))

    def _hand_over(self, pool: Pool, now: float) -> None:
        """A pool retired before it got a GPU (a plan dropped while its GPUs were still on their way) took
        prompts and prefilled requests meanwhile (`_route`); it ran none of them, so they go to the pools of
        the plan now in force, and it retires empty."""
        queue, waiting = list(pool.queue), list(pool.waiting)
        pool.queue.clear()
        pool.waiting.clear()
        pool.queued_tokens = 0
        for rid, rem in queue:
            target = self._route(PROMPT_MODES)
            target.queue.append([rid, rem])
            target.queued_tokens += rem
        self._route(DECODE_MODES).waiting.extend(waiting)
        self.fleet.try_reshape(pool, now)

    def _route(self, modes: tuple[str, ...]) -> Pool:
        """The pool of the plan that takes work of these modes (prompts, or prefilled requests for decode).
        While it is still growing from parking, a pool of the plan before that still serves takes it, so
        no request waits for a model load; a pool that waits for GPUs another pool frees takes it at once
        (that pool can only drain if it gets nothing new). Among a plan's replicas, the least backlogged.
        """
        mode = next(m for m in modes if m in self.plan_shapes)
        planned = [self.pools[k] for k in self.plan_names if pool_mode(k) == mode]
        ready = [p for p in planned if p.shape.gpus or p.deficit]
        if ready:
            return min(ready, key=backlog)
        serving = [p for p in self.pools.values() if p.mode in modes and p.shape.gpus]
        if not serving:
            return planned[0]
        return min(serving, key=lambda p: (p.next_shape is not None, backlog(p)))  # settled ones first

    def _kv_link_bytes_s(self, prefill: Pool) -> float:
        """The link a prefill pool's KV cache crosses to the decode pool: NVLink while the plan's prefill and
        decode pools (all their instances) fit one node."""
        pre, dec = self.plan_shapes.get("prefill"), self.plan_shapes.get("decode")
        gpus = (pre.gpus if pre is not None else prefill.shape.gpus) + (dec.gpus if dec is not None else 0)
        return self.spec.group_link_bytes_s(gpus)

    def _recent_rate_hz(self, now: float) -> float:
        """Arrivals per second over the last tick (what a controller can observe of the prompt rate)."""
        span = min(self.cfg.tick_s, now)
        if span <= 0:
            return 0.0
        i0, i1 = np.searchsorted(self.arr.time_s, [now - span, now])
        return float(i1 - i0) / span

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
                if pool.slack is not None:
                    pool.slack.leave(rid)
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
        self._apply_plan(0.0, self.planner.initial())
        kv_heap: list[tuple[float, int]] = []
        i = 0
        next_tick = self.cfg.tick_s
        next_window = self.cfg.window_s
        last_tick = 0.0
        now = 0.0
        while True:
            busy = [p.busy_until for p in self.pools.values() if p.pending is not None]
            t_pool = min(busy) if busy else math.inf
            t_arr = float(a.time_s[i]) if i < n else math.inf
            t_kv = kv_heap[0][0] if kv_heap else math.inf
            t_next = min(t_pool, t_arr, t_kv)
            if t_next == math.inf:
                break
            t_next = min(t_next, self.fleet.next_reshape_s(now))
            if next_tick <= t_next:
                now = next_tick
                self._tick(now, last_tick)
                last_tick = now
                if self.pol.scaling and now >= next_window:
                    self._provision(now, self.planner.load(now - self.cfg.window_s, now, burst=True))
                elif self.pol.scaling:
                    recent = self.planner.load(now - self.cfg.tick_s, now)
                    if recent.rate_rps > 1.2 * self.planned_rate:
                        self._provision(now, recent, scale_up_only=True)
                if now >= next_window:
                    next_window += self.cfg.window_s
                next_tick += self.cfg.tick_s
                continue
            now = t_next
            if t_pool == now:
                for pool in self.pools.values():
                    if pool.pending is not None and pool.busy_until <= now:
                        done = self._finish_iteration(pool, now)
                        if pool.mode in MIXED_MODES:
                            pool.waiting.extend(done)
                        else:
                            kv_link = self._kv_link_bytes_s(pool)
                            for rid in done:
                                kv_s = float(a.prompt[rid]) * self.kv_tok / kv_link
                                heapq.heappush(kv_heap, (now + kv_s, rid))
            while kv_heap and kv_heap[0][0] <= now:
                _, rid = heapq.heappop(kv_heap)
                self._route(DECODE_MODES).waiting.append(rid)
            while i < n and a.time_s[i] <= now:
                pool = self._route(PROMPT_MODES)
                pool.queue.append([i, a.prefill_tokens(i)])  # a cached prefix counts as computed
                pool.queued_tokens += a.prefill_tokens(i)
                i += 1
            for pool in self.pools.values():
                self.fleet.try_reshape(pool, now)
                if pool.pending is None:
                    self._start(pool, now)
        # close the books
        for pool in self.pools.values():
            self.fleet.close_idle(pool, now)
        self.ledger.close(now)
        self.makespan = now
        return self.results()

    def _tick(self, now: float, since: float) -> None:
        """Every policy's SLO margins follow the P90s of the last tick (shared machinery)."""
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
        return sim_results(self)

"""The scheduler's clock governor: SLO observation, the batching and clock policies, frequency commands.

Dispatch feeds it events (a first token, a finished request, an iteration sent, a microbatch done);
it answers how to form an attention worker's next iteration (`iteration_policy`) and what clock every
worker runs at in the next window (`window`). It never imports the service and publishes nothing, so
the policies are testable without NATS. The rules: docs/architecture.md, "The aflex policy, live".
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from services.scheduler.aflex import (
    BATCHING,
    AflexPlanner,
    IterationSample,
    PairPlan,
    guess_profile,
    sample_of,
    serving_order,
)
from services.scheduler.model_info import ModelInfo
from services.scheduler.passes import Pass
from services.scheduler.registry import Registry, Worker
from services.scheduler.running_bound import RunningBound
from services.scheduler.state import RequestState
from services.scheduler.window_clocks import PhaseSignal, parse_fixed_clocks, percentile, plan_clocks
from shared.gpu.base import GPUError
from shared.gpu.emulated import GPUProfile, available_profiles, load_profile
from shared.gpu.snap import snap_clock
from shared.kinds import CLOCK_PHASES, ClockPhase, FinishReason
from shared.messages import FrequencyCommand, MicrobatchDone, SchedulerTelemetry
from shared.policy import IterationPolicy
from shared.policy.decode_slack import allowance_s
from shared.policy.iteration import DecodeAwareCap, parse_depth, planner_depths
from shared.policy.pool_sizing import SLO_BUDGET_SHARE
from shared.settings import SchedulerSettings

log = logging.getLogger("aflex.scheduler")

Planned = tuple[dict[ClockPhase, int], str]  # a worker's clocks for the window, and why


@dataclass(frozen=True)
class Finished:
    """A finished request, kept for a window for SLO attainment and the clock feedback."""

    mono: float  # time.monotonic() when it finished
    reason: FinishReason
    ttft_ms: float | None
    tpot_ms: float | None


class Governor:
    def __init__(self, settings: SchedulerSettings, model: ModelInfo, registry: Registry) -> None:
        self.settings, self.registry = settings, registry
        self.fixed_clocks = parse_fixed_clocks(settings.fixed_clocks)  # a bad spec fails at start
        self.commanded: dict[str, dict[ClockPhase, int]] = {}  # worker -> clocks of its latest command
        self.finished_total = 0
        self.finished_log: deque[Finished] = deque()
        self.bounds: dict[str, RunningBound] = {}  # each attention worker's decode steps and running-set bound
        self._logged_target_s: dict[str, float | None] = {}  # the step target last logged per worker
        self.ttft_log: deque[tuple[float, float]] = deque()  # (monotonic time of the first token, TTFT ms)
        self.samples: dict[str, deque[IterationSample]] = {}  # each attention worker's iterations of the window
        self.plans: dict[str, dict[ClockPhase, PairPlan]] = {}  # the latest aflex plans
        self._profiles: dict[tuple[str, str], GPUProfile | None] = {}
        self._warned: set[str] = set()
        self.batching = BATCHING if settings.batching == "aflex" else None
        self.depth = parse_depth(settings.microbatch_depth)
        # aflex's predictors and margins: they price the aflex prefill cap, and pick the clocks under freq_policy aflex
        self.planner: AflexPlanner | None = None
        if settings.freq_policy == "aflex" or settings.batching == "aflex":
            if model.args is None:
                log.warning("aflex: the shape of model %s is unknown; no prefill cap, clocks fall back to slo",
                            model.model_id)
            else:
                self.planner = AflexPlanner(model.args, ttft_slo_ms=settings.ttft_slo_ms,
                                            tpot_slo_ms=settings.tpot_slo_ms, depths=planner_depths(self.depth),
                                            link_bytes_s=settings.freq_link_gbs * 1e9,
                                            max_batch_tokens=settings.max_batch_tokens)

    @property
    def clock_planner(self) -> AflexPlanner | None:
        """The planner when it picks the clocks (freq_policy aflex); None when another policy does."""
        return self.planner if self.settings.freq_policy == "aflex" else None

    # -- events ---------------------------------------------------------------------------------

    def first_token(self, mono: float, ttft_ms: float) -> None:
        self.ttft_log.append((mono, ttft_ms))

    def finished(self, state: RequestState, reason: FinishReason, mono: float) -> None:
        self.finished_total += 1
        ttft, tpot = state.ttft_s, state.tpot_s
        self.finished_log.append(Finished(mono, reason, None if ttft is None else ttft * 1000.0,
                                          None if tpot is None else tpot * 1000.0))

    def iteration_sent(self, worker: Worker, passes: list[Pass], depth: int, mono: float) -> None:
        if self.clock_planner is None:
            return
        window = self.samples.setdefault(worker.worker_id, deque())
        window.append(_sample(passes, mono, depth))
        while window and window[-1].mono - window[0].mono > self.settings.freq_window_s:
            window.popleft()

    def microbatch_done(self, worker: Worker, group: list[Pass], done: MicrobatchDone, ffn_id: str, *,
                        lone: bool) -> None:
        """Correct the aflex predictors from one microbatch's timings at the clocks commanded for it (they
        serve the prefill cap too, whatever picks the clocks)."""
        planner = self.planner
        if planner is None or not self.settings.freq_observe or done.error is not None or not group:
            return
        if done.attention_s <= 0 and done.ffn_wait_s <= 0 and done.ffn_compute_s <= 0:
            return
        profile = self.profile_of(worker)
        if profile is None:
            return
        sample = _sample(group, time.monotonic())
        phase = sample.phase
        planner.observe(profile, phase, sample, attention_s=done.attention_s, ffn_wait_s=done.ffn_wait_s,
                        clock_attention=self.commanded.get(worker.worker_id, {}).get(phase),
                        clock_ffn=self.commanded.get(ffn_id, {}).get(phase), lone=lone,
                        ffn_compute_s=done.ffn_compute_s)

    def worker_woken(self, worker_id: str) -> None:
        """A parked worker serves again: its clocks start over (at max under aflex), not at the parked lowest."""
        self.commanded.pop(worker_id, None)
        self.plans.pop(worker_id, None)

    def worker_restarted(self, worker_id: str) -> None:
        """A (re)started worker starts over: at max for "slo", and aflex holds nothing for it (its running-set
        bound is kept: the same hardware, and a new one would be unbounded for its first steps)."""
        self.commanded.pop(worker_id, None)

    def iteration_done(self, worker: Worker, passes: list[Pass], wall_s: float) -> None:
        """An iteration of `worker` fed `passes` in `wall_s`: a token of each decoding sequence (with any
        prompt chunks beside them: the step their requests see)."""
        self._bound(worker).step(sum(1 for p in passes if p.is_decode), wall_s)

    def _bound(self, worker: Worker) -> RunningBound:
        s = self.settings
        return self.bounds.setdefault(worker.worker_id, RunningBound(s.tpot_slo_ms / 1000.0, s.running_bound))

    # -- the iteration policy -------------------------------------------------------------------

    def iteration_policy(self, worker: Worker, now_mono: float) -> IterationPolicy:
        """How `worker`'s next iteration is formed and cut (shared.policy.plan_iteration's policy)."""
        s = self.settings
        planned = {phase: plan.op.depth for phase, plan in self.plans.get(worker.worker_id, {}).items()}
        running_bound = self._bound(worker)
        bound = running_bound.bound(len(worker.lane.running))
        max_num_seqs = s.max_num_seqs if bound is None else min(s.max_num_seqs, bound)
        self._log_target(worker, running_bound)
        return IterationPolicy(s.max_batch_tokens, max_num_seqs, self.batching, now_mono, self._prefill_cap(worker),
                               self.depth, planned, overlaps=worker.assignment != "colocated")

    def _log_target(self, worker: Worker, bound: RunningBound) -> None:
        target_s = bound.target_s
        if bound.unloaded_s is None or target_s == self._logged_target_s.get(worker.worker_id, -1.0):
            return
        self._logged_target_s[worker.worker_id] = target_s
        held = "bounded by max_num_seqs alone" if target_s is None else \
            f"held where a step takes {target_s * 1e3:.0f} ms"
        log.info("%s: its running set is %s (running_bound=%s; its shortest step %.0f ms, tpot_slo_ms=%g)",
                 worker.worker_id, held, self.settings.running_bound, bound.unloaded_s * 1e3,
                 self.settings.tpot_slo_ms)

    def _prefill_cap(self, worker: Worker) -> DecodeAwareCap | None:
        """aflex batching: the policy's prefill tokens per iteration of `worker` (None: the token budget only)."""
        planner = self.planner if self.batching is not None else None
        profile = self.profile_of(worker) if planner is not None else None
        if planner is None or profile is None:
            return None
        share = self.share()

        def cap(queued: int, n_decode: int, decode_ctx: float, head: int, oldest_wait_s: float) -> int:
            assert planner is not None and profile is not None
            return planner.prefill_tokens(profile, queued, n_decode, decode_ctx, head, share, oldest_wait_s)
        return cap

    def share(self) -> int:
        """Serving attention workers per serving FFN worker (each FFN worker serves about this many)."""
        n_attention, n_ffn = len(self.registry.serving("attention")), len(self.registry.serving("ffn"))
        return max(1, -(-n_attention // max(1, n_ffn)))

    def profile_of(self, worker: Worker) -> GPUProfile | None:
        """The worker's GPU profile: as registered, or guessed from its GPU name; None when unknown."""
        return self.profile_for(worker.gpu_profile, worker.gpu_name)

    def profile_for(self, gpu_profile: str, gpu_name: str) -> GPUProfile | None:
        """The GPU profile a worker registering with these names has (`profile_of`)."""
        key = (gpu_profile, gpu_name)
        if key not in self._profiles:
            name = guess_profile(gpu_profile, gpu_name, available_profiles())
            try:
                self._profiles[key] = load_profile(name) if name else None
            except GPUError:
                self._profiles[key] = None
        return self._profiles[key]

    # -- SLO observation ------------------------------------------------------------------------

    @property
    def stats_window_s(self) -> float:
        """SLO attainment and p90s cover requests finished within this many seconds."""
        hz = self.settings.telemetry_hz
        return max(self.settings.freq_window_s, 1.0 / hz if hz > 0 else 0.0)

    def _prune(self, now: float) -> None:
        keep = self.stats_window_s
        while self.finished_log and now - self.finished_log[0].mono > keep:
            self.finished_log.popleft()
        while self.ttft_log and now - self.ttft_log[0][0] > keep:
            self.ttft_log.popleft()

    def signals(self, now: float, requests: Iterable[RequestState]) -> dict[ClockPhase, PhaseSignal]:
        """TTFT (prefill) and TPOT (decode) seen in the last frequency window, for the clock planner.

        TTFT: every first token of the window; a request still waiting for its first token longer
        than the SLO counts as a miss. TPOT: requests finished in the window, and running ones that
        streamed in it (their TPOT so far), so long requests steer the clocks before they end.
        """
        self._prune(now)
        window = self.settings.freq_window_s
        ttft_slo, tpot_slo = self.settings.ttft_slo_ms, self.settings.tpot_slo_ms
        ttfts = [ms for t, ms in self.ttft_log if now - t <= window]
        tpots = [f.tpot_ms for f in self.finished_log if now - f.mono <= window and f.tpot_ms is not None]
        ttft_miss = sum(ms > ttft_slo for ms in ttfts)
        unix = time.time()
        for state in requests:
            if state.first_token_ts is None:
                ttft_miss += (unix - state.arrival_ts) * 1000.0 > ttft_slo
            elif state.last_token_ts is not None and unix - state.last_token_ts <= window:
                tpot = state.tpot_s
                if tpot is not None:
                    tpots.append(tpot * 1000.0)
        tpot_miss = sum(ms > tpot_slo for ms in tpots)
        ttft_count = len(ttfts) + ttft_miss - sum(ms > ttft_slo for ms in ttfts)  # late waiters count too
        return {"prefill": PhaseSignal(percentile(ttfts, 90), ttft_slo, ttft_miss, ttft_count),
                "decode": PhaseSignal(percentile(tpots, 90), tpot_slo, tpot_miss, len(tpots))}

    # -- frequency commands ---------------------------------------------------------------------

    def commands(self, now_mono: float, requests: Iterable[RequestState],
                 only: list[Worker] | None = None) -> list[FrequencyCommand]:
        """A frequency window's commands (`window`), or with `only`, commands for those workers now (their
        assignment changed), the window's plans unchanged."""
        if only is None:
            return self.window(now_mono, requests)
        signals = self.signals(now_mono, requests)
        return [self.command(w, signals) for w in only if w.healthy and w.supported_clocks_mhz]

    def window(self, now_mono: float, requests: Iterable[RequestState]) -> list[FrequencyCommand]:
        """One frequency window: a command for every healthy worker with supported clocks."""
        signals = self.signals(now_mono, requests)
        planned: dict[str, Planned] = {}
        if self.clock_planner is not None:
            self.clock_planner.update_margins({p: (sig.p90_ms, sig.misses, sig.count) for p, sig in signals.items()})
            planned = self._aflex_window(self.clock_planner, now_mono, requests)
        return [self.command(w, signals, planned.get(w.worker_id))
                for w in sorted(self.registry.workers.values(), key=lambda w: w.worker_id)
                if w.healthy and w.supported_clocks_mhz]

    def command(self, worker: Worker, signals: dict[ClockPhase, PhaseSignal],
                planned: Planned | None = None) -> FrequencyCommand:
        """The worker's command for this window (and what it was told last, for the next one)."""
        policy = self.settings.freq_policy
        previous = self.commanded.get(worker.worker_id)
        if worker.parked and worker.drained:  # warm: the model kept, the GPU at its lowest clock
            clocks, reason = {p: worker.supported_clocks_mhz[0] for p in CLOCK_PHASES}, f"{worker.assignment}"
        elif planned is not None:
            clocks, reason = planned
        elif self.clock_planner is not None and self.profile_of(worker) is not None:
            top = worker.supported_clocks_mhz[-1]
            clocks = dict(previous) if previous else {p: top for p in CLOCK_PHASES}
            reason = "aflex: hold" if previous else "aflex: start at max"
        else:
            fallback = policy == "aflex"
            if fallback and worker.worker_id not in self._warned:
                self._warned.add(worker.worker_id)
                why = "the model's shape is unknown" if self.planner is None else \
                    f"GPU profile unknown (profile {worker.gpu_profile!r}, name {worker.gpu_name!r})"
                log.warning("clock policy aflex: worker %s falls back to slo: %s", worker.worker_id, why)
            clocks, reason = plan_clocks("slo" if fallback else policy, worker.role, worker.supported_clocks_mhz,
                                         previous=previous, signals=signals, fixed=self.fixed_clocks)
            if fallback:
                reason += " (aflex fallback)"
        self.commanded[worker.worker_id] = clocks
        now = time.time()
        return FrequencyCommand(worker_id=worker.worker_id, clocks_mhz=clocks, issued_ts=now,
                                valid_until_ts=now + 3 * self.settings.freq_window_s, reason=reason)

    def _aflex_window(self, planner: AflexPlanner, now_mono: float,
                      requests: Iterable[RequestState] = ()) -> dict[str, Planned]:
        """Clocks for every worker aflex can plan: each attention worker from its own pair plan, each FFN
        worker at the highest FFN clock any pair asks for; a phase nothing ran in holds its clock."""
        attention, ffn = self.registry.serving("attention"), self.registry.serving("ffn")
        share, now_unix = self.share(), time.time()
        banked = least_allowances(requests, planner.tpot_slo_ms / 1e3 * SLO_BUDGET_SHARE, now_unix)
        fresh: dict[str, dict[ClockPhase, PairPlan]] = {}
        for w in attention:
            window = self.samples.get(w.worker_id, deque())
            while window and now_mono - window[0].mono > self.settings.freq_window_s:
                window.popleft()
            profile = self.profile_of(w)
            if profile is None or not window:
                continue
            waiting = list(w.lane.waiting)
            order = serving_order(now_mono, [(s.received_mono, float(s.pending_tokens)) for s in waiting],
                                  planner.batching, [s.priority for s in waiting])
            queue = [(waiting[k].arrival_ts, float(waiting[k].pending_tokens)) for k in order]
            previous = self.plans.setdefault(w.worker_id, {})
            for phase in CLOCK_PHASES:
                prev = previous.get(phase)
                plan = planner.plan_pair(profile, phase, list(window), share, now_unix,
                                         queue if phase == "prefill" else (), prev.op if prev else None,
                                         colocated=w.assignment == "colocated",
                                         banked_s=banked.get(w.worker_id, 0.0))
                if plan is not None:
                    previous[phase] = plan
                    fresh.setdefault(w.worker_id, {})[phase] = plan
        out: dict[str, Planned] = {}
        for w in [*attention, *ffn]:
            if not w.supported_clocks_mhz or self.profile_of(w) is None:
                continue
            table, before = w.supported_clocks_mhz, self.commanded.get(w.worker_id, {})
            clocks: dict[ClockPhase, int] = {}
            why = []
            for phase in CLOCK_PHASES:
                plans = [p[phase] for wid, p in fresh.items()  # an FFN worker: the pairs that use FFN workers
                         if phase in p and (wid == w.worker_id if w.role == "attention" else p[phase].shape.split)]
                if not plans:
                    clocks[phase] = before.get(phase, table[-1])
                    why.append(f"{phase} idle: hold")
                    continue
                top = max(plans, key=lambda p: p.op.clock_ffn if w.role == "ffn" else p.op.clock_attention)
                op = top.op
                clocks[phase] = snap_clock(table, op.clock_ffn if w.role == "ffn" else op.clock_attention, "up")
                why.append(f"{phase} {top.stats.n_tokens:.0f} tok/{top.stats.ctx_tokens:.0f} ctx, budget "
                           f"{top.budget_s * 1e3:.1f} ms, depth {op.depth}: A {op.clock_attention:.0f} / "
                           f"F {op.clock_ffn:.0f} MHz{'' if op.feasible else ' (infeasible: fastest)'}")
            margins = planner.margins
            out[w.worker_id] = (clocks, f"aflex (margins {margins['prefill'].margin:.2f}/"
                                        f"{margins['decode'].margin:.2f}): " + "; ".join(why))
        return out

    # -- telemetry ------------------------------------------------------------------------------

    def telemetry(self, queue_depth: int, running: int, plan_id: int = 0) -> SchedulerTelemetry:
        now = time.monotonic()
        self._prune(now)
        ttft_slo, tpot_slo = self.settings.ttft_slo_ms, self.settings.tpot_slo_ms
        done = [f for f in self.finished_log if f.reason != "abort"]  # a client's cancel is no miss
        good = sum(f.reason != "error" and f.ttft_ms is not None and f.ttft_ms <= ttft_slo
                   and (f.tpot_ms or 0.0) <= tpot_slo for f in done)
        ttfts = [f.ttft_ms for f in done if f.ttft_ms is not None]
        tpots = [f.tpot_ms for f in done if f.tpot_ms is not None]
        clocks = {wid: {str(p): mhz for p, mhz in c.items()} for wid, c in self.commanded.items()
                  if (w := self.registry.workers.get(wid)) is not None and w.healthy}
        return SchedulerTelemetry(
            scheduler_id=self.settings.scheduler_id, ts=time.time(), queue_depth=queue_depth, running=running,
            finished=self.finished_total, slo_attainment=good / len(done) if done else None,
            ttft_p90_ms=percentile(ttfts, 90), tpot_p90_ms=percentile(tpots, 90), clocks_mhz=clocks,
            assignments={w.worker_id: w.assignment for w in self.registry.workers.values()
                         if w.healthy and w.assignment is not None}, plan_id=plan_id)


def least_allowances(requests: Iterable[RequestState], per_token_s: float, now_unix: float) -> dict[str, float]:
    """Each worker's least `decode_slack.allowance_s` over the requests decoding on it (their first token out)."""
    out: dict[str, float] = {}
    for state in requests:
        if state.worker_id is None or state.first_token_ts is None or state.finished:
            continue
        left = allowance_s(per_token_s, max(0, len(state.output_ids) - 1), now_unix - state.first_token_ts)
        out[state.worker_id] = min(left, out.get(state.worker_id, left))
    return out


def _sample(passes: list[Pass], mono: float, depth: int = 1) -> IterationSample:
    return sample_of(((p.n_new, p.start, p.samples, p.is_decode, len(p.state.prompt_ids)) for p in passes),
                     mono, depth)

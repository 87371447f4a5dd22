"""The scheduler's clock governor: what clock every worker runs at in the next frequency window.

Dispatch tells it what each attention worker ran (`iteration_sent`, `microbatch_done`); each window it
reads the SLO watch's TTFT and TPOT (slo_watch.py) and answers a `FrequencyCommand` per worker
(`window`): under `--freq-policy aflex` each attention worker's pair plan (aflex.py), else the slo, max
or fixed rule (window_clocks.py). It corrects the aflex predictors from the timings at the clocks it
commanded, which price the prefill cap too. How iterations are formed is batching.py's. It never imports
the service and publishes nothing, so the policies are testable without NATS. The rules:
docs/architecture.md, "The aflex policy, live".
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable

from services.scheduler.aflex import AflexPlanner, IterationSample, PairPlan, sample_of, serving_order
from services.scheduler.passes import Pass
from services.scheduler.profiles import Profiles
from services.scheduler.registry import Registry, Worker
from services.scheduler.slo_watch import SloWatch
from services.scheduler.state import RequestState
from services.scheduler.window_clocks import PhaseSignal, parse_fixed_clocks, plan_clocks
from shared.gpu.snap import snap_clock
from shared.kinds import CLOCK_PHASES, ClockPhase, runs_own_ffn
from shared.messages import FrequencyCommand, MicrobatchDone
from shared.policy.decode_slack import allowance_s
from shared.policy.pool_sizing import SLO_BUDGET_SHARE
from shared.settings import SchedulerSettings

log = logging.getLogger("aflex.scheduler")

Planned = tuple[dict[ClockPhase, int], str]  # a worker's clocks for the window (MHz), and why


class Governor:
    def __init__(self, settings: SchedulerSettings, registry: Registry, planner: AflexPlanner | None,
                 profiles: Profiles, slo: SloWatch) -> None:
        self.settings, self.registry, self.profiles, self.slo = settings, registry, profiles, slo
        # aflex's predictors and margins: they price the aflex prefill cap, and pick the clocks under freq_policy aflex
        self.planner = planner
        self.fixed_clocks = parse_fixed_clocks(settings.fixed_clocks)  # a bad spec fails at start
        self.commanded_mhz: dict[str, dict[ClockPhase, int]] = {}  # worker -> clocks of its latest command
        self.samples: dict[str, deque[IterationSample]] = {}  # each attention worker's iterations of the window
        self.plans: dict[str, dict[ClockPhase, PairPlan]] = {}  # the latest aflex plans
        self._warned: set[str] = set()

    @property
    def clock_planner(self) -> AflexPlanner | None:
        """The planner when it picks the clocks (freq_policy aflex); None when another policy does."""
        return self.planner if self.settings.freq_policy == "aflex" else None

    # -- events ---------------------------------------------------------------------------------

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
        profile = self.profiles.of(worker)
        if profile is None:
            return
        sample = _sample(group, time.monotonic())
        phase = sample.phase
        planner.observe(profile, phase, sample, attention_s=done.attention_s, ffn_wait_s=done.ffn_wait_s,
                        clock_attention=self.commanded_mhz.get(worker.worker_id, {}).get(phase),
                        clock_ffn=self.commanded_mhz.get(ffn_id, {}).get(phase), lone=lone,
                        ffn_compute_s=done.ffn_compute_s)

    def worker_woken(self, worker_id: str) -> None:
        """A parked worker serves again: its clocks start over (at max under aflex), not at the parked lowest."""
        self.commanded_mhz.pop(worker_id, None)
        self.plans.pop(worker_id, None)

    def worker_restarted(self, worker_id: str) -> None:
        """A (re)started worker starts over: at max for "slo", and aflex holds nothing for it (batching keeps its
        running-set bound: the same hardware, and a new one would be unbounded for its first steps)."""
        self.commanded_mhz.pop(worker_id, None)

    # -- what others read -----------------------------------------------------------------------

    def planned_depth(self, worker_id: str) -> dict[ClockPhase, int]:
        """The microbatch depth the worker's latest aflex plan chose per phase (batching cuts by it under auto)."""
        return {phase: plan.op.depth for phase, plan in self.plans.get(worker_id, {}).items()}

    def clocks_mhz(self) -> dict[str, dict[str, int]]:
        """The clocks last commanded to each healthy worker, as telemetry carries them."""
        return {wid: {str(p): mhz for p, mhz in c.items()} for wid, c in self.commanded_mhz.items()
                if (w := self.registry.workers.get(wid)) is not None and w.healthy}

    # -- frequency commands ---------------------------------------------------------------------

    def commands(self, now_mono: float, requests: Iterable[RequestState],
                 only: list[Worker] | None = None) -> list[FrequencyCommand]:
        """A frequency window's commands (`window`), or with `only`, commands for those workers now (their
        assignment changed), the window's plans unchanged."""
        if only is None:
            return self.window(now_mono, requests)
        signals = self.slo.signals(now_mono, requests)
        return [self.command(w, signals) for w in only if w.healthy and w.supported_clocks_mhz]

    def window(self, now_mono: float, requests: Iterable[RequestState]) -> list[FrequencyCommand]:
        """One frequency window: a command for every healthy worker with supported clocks."""
        signals = self.slo.signals(now_mono, requests)
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
        previous = self.commanded_mhz.get(worker.worker_id)
        if worker.parked and worker.drained:  # warm: the model kept, the GPU at its lowest clock
            clocks, reason = {p: worker.supported_clocks_mhz[0] for p in CLOCK_PHASES}, f"{worker.assignment}"
        elif planned is not None:
            clocks, reason = planned
        elif self.clock_planner is not None and self.profiles.of(worker) is not None:
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
        self.commanded_mhz[worker.worker_id] = clocks
        now = time.time()
        return FrequencyCommand(worker_id=worker.worker_id, clocks_mhz=clocks, issued_ts=now,
                                valid_until_ts=now + 3 * self.settings.freq_window_s, reason=reason)

    def _aflex_window(self, planner: AflexPlanner, now_mono: float,
                      requests: Iterable[RequestState] = ()) -> dict[str, Planned]:
        """Clocks for every worker aflex can plan: each attention worker from its own pair plan, each FFN
        worker at the highest FFN clock any pair asks for; a phase nothing ran in holds its clock."""
        attention, ffn = self.registry.serving("attention"), self.registry.serving("ffn")
        share, now_unix = self.registry.attention_per_ffn(), time.time()
        banked = least_allowances(requests, planner.tpot_slo_ms / 1e3 * SLO_BUDGET_SHARE, now_unix)
        fresh: dict[str, dict[ClockPhase, PairPlan]] = {}
        for w in attention:
            window = self.samples.get(w.worker_id, deque())
            while window and now_mono - window[0].mono > self.settings.freq_window_s:
                window.popleft()
            profile = self.profiles.of(w)
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
                                         colocated=runs_own_ffn(w.assignment),
                                         banked_s=banked.get(w.worker_id, 0.0))
                if plan is not None:
                    previous[phase] = plan
                    fresh.setdefault(w.worker_id, {})[phase] = plan
        out: dict[str, Planned] = {}
        for w in [*attention, *ffn]:
            if not w.supported_clocks_mhz or self.profiles.of(w) is None:
                continue
            table, before = w.supported_clocks_mhz, self.commanded_mhz.get(w.worker_id, {})
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

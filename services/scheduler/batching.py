"""The batching policy: how each attention worker's next iteration is formed and cut.

`--batching aflex` serves the queue shortest prompt first with aging (the simulator's rule) and caps
each iteration's prompt tokens by the SLOs (`PrefillCap`); `fcfs` serves it in arrival order within
the token budget. Either way the running set is held where the worker's own steps meet the TPOT SLO
(`RunningBound`), and the iteration is cut into `microbatch_depth` microbatches (under "auto", the
depth the clock plan chose). Apart from the clock governor because it answers per iteration of one
worker, from that worker's queue; the governor answers per window, for every worker.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from services.scheduler.aflex import BATCHING, AflexPlanner
from services.scheduler.passes import Pass
from services.scheduler.prefill_cap import PrefillCap
from services.scheduler.profiles import Profiles
from services.scheduler.registry import Registry, Worker
from services.scheduler.running_bound import RunningBound
from shared.kinds import ClockPhase, runs_own_ffn
from shared.policy import IterationPolicy
from shared.policy.iteration import parse_depth
from shared.settings import SchedulerSettings

log = logging.getLogger("aflex.scheduler")


class BatchingPolicy:
    """Each attention worker's iteration policy, and the running-set bound its steps feed."""

    def __init__(self, settings: SchedulerSettings, registry: Registry, planner: AflexPlanner | None,
                 profiles: Profiles) -> None:
        self.settings, self.registry, self.planner, self.profiles = settings, registry, planner, profiles
        self.rule = BATCHING if settings.batching == "aflex" else None  # None: first-come first-served
        self.depth = parse_depth(settings.microbatch_depth)
        self.bounds: dict[str, RunningBound] = {}  # each attention worker's decode steps and running-set bound
        self._logged_target_s: dict[str, float | None] = {}  # the step target last logged per worker

    def iteration_policy(self, worker: Worker, now_mono: float,
                         planned_depth: Mapping[ClockPhase, int]) -> IterationPolicy:
        """How `worker`'s next iteration is formed and cut (shared.policy.plan_iteration's policy);
        `planned_depth`: the depth its clock plan chose per phase (`Governor.planned_depth`)."""
        s = self.settings
        running_bound = self._bound(worker)
        bound = running_bound.bound(len(worker.lane.running))
        max_num_seqs = s.max_num_seqs if bound is None else min(s.max_num_seqs, bound)
        self._log_target(worker, running_bound)
        return IterationPolicy(s.max_batch_tokens, max_num_seqs, self.rule, now_mono, self.prefill_cap(worker),
                               self.depth, planned_depth, overlaps=not runs_own_ffn(worker.assignment))

    def prefill_cap(self, worker: Worker) -> PrefillCap | None:
        """aflex batching: `worker`'s prefill cap for this iteration (None: the token budget only)."""
        profile = self.profiles.of(worker) if self.rule is not None and self.planner is not None else None
        if self.planner is None or profile is None:
            return None
        return PrefillCap(self.planner, profile, self.registry.attention_per_ffn())

    def iteration_done(self, worker: Worker, passes: list[Pass], wall_s: float) -> None:
        """An iteration of `worker` fed `passes` in `wall_s`: a token of each decoding sequence (with any
        prompt chunks beside them: the step their requests see)."""
        self._bound(worker).step(sum(1 for p in passes if p.is_decode), wall_s)

    def _bound(self, worker: Worker) -> RunningBound:
        s = self.settings
        return self.bounds.setdefault(worker.worker_id, RunningBound(s.tpot_slo_ms / 1000.0, s.running_bound))

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

"""The live global scheduler's power correction: the simulator's rule (`PowerCorrection`) on the mesh's own meters.

The simulator's AFlex ranks plan kinds by predicted power times what each kind's plans drew against what
the pool models said they would (shared/policy/power_correction.py). Live, what a plan drew is the sum of
every worker's GPU energy counter (NVML, or the emulated GPU's model) over the stretch it was in force,
parked workers included: the `cluster` accounting the live planner prices (a parked worker at its
parking state's power). Each worker's counter comes with its heartbeats (`Heartbeat.gpu_energy_j`); a
counter that went back (the worker restarted) counts from zero again, and a worker that reports none adds
nothing (its stretch is then under-counted, so a mesh of such workers keeps every factor near its first).

A stretch starts when a plan is applied and is folded in at the next window: against `plan_power_w` of
that plan at the load that came meanwhile, as the simulator does. A kind's first stretch must last
`PowerCorrection.min_span_s`; a shorter one keeps growing while the plan stays the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.perf import Predictor
from shared.policy import ClockRule, ClusterSpec, Plan, WindowLoad
from shared.policy.footprint import plan_power_w
from shared.policy.power_correction import PowerCorrection


class MeshEnergy:
    """The mesh's energy so far (J): each worker's monotonic counter, summed by increments."""

    def __init__(self) -> None:
        self.total_j = 0.0
        self._last_j: dict[str, float] = {}

    def report(self, worker_id: str, counter_j: float | None) -> None:
        if counter_j is None:
            return
        last = self._last_j.get(worker_id)
        if last is not None:
            self.total_j += counter_j - last if counter_j >= last else counter_j  # went back: restarted
        self._last_j[worker_id] = counter_j


@dataclass(frozen=True)
class Stretch:
    since_mono: float
    plan: Plan
    spec: ClusterSpec
    energy_j: float  # the mesh's energy when it began


class LivePowerCorrection:
    def __init__(self, window_s: float) -> None:
        self.correction = PowerCorrection(window_s)
        self.energy = MeshEnergy()
        self.stretch: Stretch | None = None

    def observe(self, now_mono: float, pred: Predictor, rule: ClockRule, load: WindowLoad,
                slo_met: bool) -> bool:
        """Fold the stretch in force up to now (`load`: the load that came over it) into its kind's factor;
        False when there is none, the model has no figure for it (an overload), or it is too short yet."""
        s = self.stretch
        if s is None or now_mono <= s.since_mono:
            return False
        predicted_w = plan_power_w(pred, s.plan, load, s.spec, rule)
        folded = predicted_w is not None and self.correction.observe(
            s.plan.kind, predicted_w, self.energy.total_j - s.energy_j, now_mono - s.since_mono, slo_met)
        if folded or predicted_w is None:  # folded in, or an overload (left out): the next stretch starts now
            self.applied(now_mono, s.plan, s.spec, restart=True)
        return folded

    def applied(self, now_mono: float, plan: Plan, spec: ClusterSpec, restart: bool = False) -> None:
        """The plan in force from now: a new stretch unless it is the one already running (or `restart`)."""
        s = self.stretch
        if restart or s is None or s.plan != plan or s.spec != spec:
            self.stretch = Stretch(now_mono, plan, spec, self.energy.total_j)

    def factors(self, kinds: tuple[str, ...]) -> dict[str, float] | None:
        """What `elastic_plan` multiplies each kind's power by (None with one kind: nothing to rank)."""
        return self.correction.factors(kinds) if len(kinds) > 1 else None

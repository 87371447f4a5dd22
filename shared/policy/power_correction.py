"""Each plan kind's predicted power, corrected by the energy its plans drew: one rule for the simulator and the mesh.

`footprint.elastic_plan` ranks plan kinds ("pd", "colocated", ...) by predicted power, and the pool
models do not err alike for every kind: on conv-Mixtral ×2 (`active`) they price P/D pools below
colocated replicas, while the replicas draw about 0.84 of what the models say and the P/D pools
about 1.0 (docs/evaluation.md). So after each stretch a plan was in force, the energy charged for it
(in the accounting the planner prices) is set against what the pool models predict that plan draws
at the load that came meanwhile (`footprint.plan_power_w`), not against the power it was planned at:
that one is priced at a burst quantile of the load times a headroom that grows after TTFT misses, an
error of the forecast, shared by every kind, and not of the kind's model. The kind's factor is the
ratio of the two energies, each summed with an exponential discount (`memory`: the weight an
observation keeps one window later), so long stretches weigh more than short ones and a kind's first
observation sets its factor outright. The factor scales only the ranking between kinds; a plan keeps
the model's `predicted_power_w`.

A kind never observed is priced at the mean factor of the observed kinds (1.0 before any), with no
optimism bonus: the best guess for a model never checked is the error the checked ones share. So the
kinds stay in the model's order until each has run, and a kind is tried exactly when the model ranks
it first. A bonus would pay a drain and a switch of the whole cluster, and an SLO risk, to learn about
a kind the model does not favour. Pricing it at 1.0 was measured too: the running kind's factor below
1 then held the other kind out for good, and code-Mixtral ×0.25 never left P/D pools (+7.5% energy,
losing the cell to BiScale).

A kind whose stretch missed the TPOT SLO (the P90 TPOT of the requests that came in it and finished), at a
load its plan was sized for, is not returned to at that load or above (`barred`): the pool models
misjudged that kind's decode there (colocated replicas whose decode steps share iterations with prefill
chunks, under MLPerf's 40 ms TPOT), and a heavier load will not bring it back under. It gives way to any
other kind that holds the load before the headroom (`footprint.weigh_kinds`); only where every kind has
failed at this load is none barred. TTFT misses bar nothing: they come with bursts the forecast missed,
which the headroom answers (`AdaptiveHeadroom`), and barring on them cost 1.9% on code-Mixtral and 51 ms
of P90 TTFT on code-Qwen3 (docs/evaluation.md).

The factor prices energy among kinds that meet the SLO. The pool models misjudge TTFT too: on the
bursty Coding trace under `active`, colocated replicas drew 0.65 of their prediction while their P90
TTFT missed the SLO (471 ms at ×1; the headroom corrects every kind alike). So a kind whose latest
stretch missed the P90 TTFT SLO gets no advantage from its factor: it is ranked no cheaper against
the other kinds than the model ranks it, until a stretch of it meets the SLO again.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PowerCorrection:
    window_s: float = 300.0
    memory: float = 0.5  # the weight an observation keeps one window later
    min_span_s: float = 30.0  # a kind's first observation must be this long (a short one sets its factor on noise)
    bounds: tuple[float, float] = (0.25, 4.0)
    # kind -> (observed J, predicted J), both discounted alike
    sums: dict[str, tuple[float, float]] = field(default_factory=dict)
    missed: set[str] = field(default_factory=set)  # kinds whose latest stretch missed the SLO
    failed_at_rps: dict[str, float] = field(default_factory=dict)  # the least load a kind's stretch missed an SLO at

    def observe(self, kind: str, predicted_w: float, observed_j: float, span_s: float, slo_met: bool = True) -> bool:
        """Fold in `span_s` seconds in which a plan of `kind`, predicted at `predicted_w`, drew `observed_j`
        (`slo_met`: within the P90 TTFT SLO); False: too short to be a kind's first observation (the caller
        keeps the stretch growing)."""
        if span_s <= 0 or predicted_w <= 0 or (kind not in self.sums and span_s < self.min_span_s):
            return False
        keep = self.memory ** (span_s / self.window_s)
        obs_j, pred_j = self.sums.get(kind, (0.0, 0.0))
        self.sums[kind] = (keep * obs_j + observed_j, keep * pred_j + predicted_w * span_s)
        (self.missed.discard if slo_met else self.missed.add)(kind)
        return True

    def judged(self, kind: str, slo_met: bool, load_rps: float, span_s: float | None = None,
               planned_rps: float | None = None) -> None:
        """A stretch of `kind` met the TPOT SLO or did not, at `load_rps`. It counts only when it lasted
        `min_span_s` (`span_s`; None: it did) and its plan was sized for that load (`planned_rps`: the load it
        was planned for; None: it was): a miss past the plan's load is the forecast's, not the kind's."""
        if (span_s is not None and span_s < self.min_span_s) or (planned_rps is not None and load_rps > planned_rps):
            return
        if not slo_met:
            self.failed_at_rps[kind] = min(load_rps, self.failed_at_rps.get(kind, load_rps))

    def barred(self, kinds: tuple[str, ...], load_rps: float) -> frozenset[str]:
        """The kinds of `kinds` that missed an SLO at `load_rps` or a lighter load; none when all of them did."""
        out = frozenset(k for k in kinds if k in self.failed_at_rps and self.failed_at_rps[k] <= load_rps)
        return out if len(out) < len(kinds) else frozenset()

    def factor(self, kind: str) -> float:
        """What `kind`'s predicted power is multiplied by (a kind never observed: the observed kinds' mean). A
        kind whose latest stretch missed the SLO is ranked no cheaper, against the others, than the model ranks it."""
        own = self._ratio(kind)
        if kind in self.missed:
            return max([own, *(self._ratio(k) for k in self.sums if k != kind)])
        return own

    def _ratio(self, kind: str) -> float:
        if kind in self.sums:
            obs_j, pred_j = self.sums[kind]
            lo, hi = self.bounds
            return min(hi, max(lo, obs_j / pred_j))
        seen = [self._ratio(k) for k in self.sums]
        return sum(seen) / len(seen) if seen else 1.0

    def factors(self, kinds: tuple[str, ...]) -> dict[str, float]:
        """The factor of every kind in `kinds` (what `elastic_plan` takes)."""
        return {k: self.factor(k) for k in kinds}

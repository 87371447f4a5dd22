"""The provisioning headroom, corrected by what the last window's TTFT says: one rule for the simulator and the mesh.

A plan holds `base` × the load it saw. The pool models have no queueing term for bursts inside a
window, so on a bursty trace (Azure Coding) a plan that the models call feasible can miss the TTFT
SLO all window. Each time the global scheduler plans (every window, and when a burst makes it grow
its pools), it looks at the P90 TTFT of the window before: over the SLO, the factor grows by `up` (at
most `max_factor`); under `relax_below` of it, it shrinks by `down` back toward 1. Over a whole
window, not a 30-second tick: a short burst inside a window that meets the SLO moves nothing
(measured, docs/evaluation.md: feedback on every tick's P90 cost up to 7% where the hour met its SLO).
"""

from __future__ import annotations

from dataclasses import dataclass

# a P90 under this fraction of its SLO is comfortably inside: the SLO feedback loops (this headroom, and
# `operating_point.SloMargin`'s margin) give back what they hold in reserve only then
RELAX_BELOW_SLO = 0.7


def comfortably_inside(p90_ms: float, slo_ms: float, fraction: float = RELAX_BELOW_SLO) -> bool:
    """Whether a P90 lies far enough under its SLO for a feedback loop to loosen."""
    return p90_ms < fraction * slo_ms


@dataclass
class AdaptiveHeadroom:
    base: float = 1.3
    factor: float = 1.0
    up: float = 1.15
    down: float = 0.97
    max_factor: float = 2.0
    relax_below: float = RELAX_BELOW_SLO

    def update(self, p90_ttft_ms: float | None, ttft_slo_ms: float) -> float:
        """Fold one provisioning window's P90 TTFT (None: nothing started in it) in; returns the headroom."""
        if p90_ttft_ms is not None:
            if p90_ttft_ms > ttft_slo_ms:
                self.factor = min(self.max_factor, self.factor * self.up)
            elif comfortably_inside(p90_ttft_ms, ttft_slo_ms, self.relax_below):
                self.factor = max(1.0, self.factor * self.down)
        return self.headroom

    @property
    def headroom(self) -> float:
        return self.base * self.factor

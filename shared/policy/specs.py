"""The `aflex` policy's constants, one definition for the live scheduler and the simulator.

Both import these (`services.scheduler.aflex`, `loadgen.sim.policies`), so what the
simulator evaluates is what the mesh serves with, not a copy that can drift from it.
"""

from __future__ import annotations

from shared.policy.batching import BatchingRule

# shortest remaining prompt first with aging; a prefill-only iteration lasts at most 30% of the TTFT SLO
AFLEX_BATCHING = BatchingRule(adaptive=True, order="srpt", prefill_iter_frac=0.3)
# `ClockRule.objective`: decode iterations scored by energy above the pool's idle floor, prefill by total energy
# and, when the queue empties, the idle pool until the next prompt (see ClockRule)
AFLEX_CLOCK_OBJECTIVE = "idle-aware"

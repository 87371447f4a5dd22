"""The serving machinery every policy shares: one definition for the live scheduler and the simulator.

AFlex's live scheduler serves with these (`services.scheduler.aflex`), the simulator's `aflex` evaluates
them, and every simulated baseline gets them too unless its own paper says otherwise (issue 38; each
exception is cited in docs/evaluation.md, "Fairness"). Batching order, chunking and the clock objective
are serving machinery, not AFlex's own ideas: a rival without them would lose for want of them.
"""

from __future__ import annotations

from dataclasses import replace

from shared.policy.batching import BatchingRule

# shortest remaining prompt first with aging; a prefill-only iteration lasts at most 30% of the TTFT SLO
SHARED_BATCHING = BatchingRule(adaptive=True, order="srpt", prefill_iter_frac=0.3)
# `ClockRule.objective`: decode iterations scored by energy above the pool's idle floor, prefill by total energy
# and, when the queue empties, the idle pool until the next prompt (see ClockRule)
SHARED_CLOCK_OBJECTIVE = "idle-aware"
# AFlex's own, beside the shared machinery: each iteration's decode budget is its requests' banked TPOT
# (`decode_slack.py`; issue 38, part 5). Its ablation is the simulator's `aflex-no-decode-slack`.
AFLEX_BATCHING = replace(SHARED_BATCHING, decode_slack=True)

"""aflex batching's prefill cap: how many prompt tokens one attention worker's next iteration may take.

As many as the SLOs leave room for at the top clocks: a prefill-only iteration within
`prefill_iter_frac` of the TTFT SLO, one beside decode steps within their TPOT budget, more for a
prompt waiting past its TTFT (`AflexPlanner.prefill_tokens`, on `shared.policy.prefill_cap`). The
iteration former asks it once it has taken the decode steps, about the queue that is left, with a
`shared.policy.PrefillQuery`: the cap adds what the former cannot know, the worker's GPU and the fleet's shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.aflex import AflexPlanner
from shared.gpu.emulated import GPUProfile
from shared.policy import PrefillQuery


@dataclass(frozen=True)
class PrefillCap:
    """One worker's cap for one iteration: its GPU profile and the fleet's shape when the iteration is formed
    (`IterationPolicy.prefill_cap`)."""

    planner: AflexPlanner
    profile: GPUProfile
    share: int  # attention workers per FFN worker (`Registry.attention_per_ffn`)

    def __call__(self, query: PrefillQuery) -> int:
        """The most prefill tokens the iteration may take."""
        return self.planner.prefill_tokens(self.profile, query, self.share)

"""aflex batching's prefill cap: how many prompt tokens one attention worker's next iteration may take.

As many as the SLOs leave room for at the top clocks: a prefill-only iteration within
`prefill_iter_frac` of the TTFT SLO, one beside decode steps within their TPOT budget, more for a
prompt waiting past its TTFT (`AflexPlanner.prefill_tokens`, on `shared.policy.prefill_cap`). The
iteration former asks it once it has taken the decode steps, about the queue that is left: the
question is a `PrefillQuery`, so what the former knows and what the cap reads are named fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.aflex import AflexPlanner
from shared.gpu.emulated import GPUProfile


@dataclass(frozen=True)
class PrefillQuery:
    """What the former knows of the iteration it is forming when it asks the cap."""

    queued_tokens: int  # the prompt tokens left in the queue
    n_decode: int  # decode steps already in the iteration
    decode_ctx_tokens: float  # their context tokens, together
    head_tokens: int  # the prompt tokens left of the queue's first request, in serving order
    oldest_wait_s: float  # how long the longest-queued prompt has waited


@dataclass(frozen=True)
class PrefillCap:
    """One worker's cap for one iteration: its GPU profile and the fleet's shape when the iteration is formed."""

    planner: AflexPlanner
    profile: GPUProfile
    share: int  # attention workers per FFN worker (`Registry.attention_per_ffn`)

    def tokens(self, query: PrefillQuery) -> int:
        """The most prefill tokens the iteration may take."""
        return self.planner.prefill_tokens(self.profile, query.queued_tokens, query.n_decode,
                                           query.decode_ctx_tokens, query.head_tokens, self.share,
                                           query.oldest_wait_s)

    def __call__(self, queued_tokens: int, n_decode: int, decode_ctx_tokens: float, head_tokens: int,
                 oldest_wait_s: float) -> int:
        """The question in `shared.policy.iteration`'s positional form (`DecodeAwareCap`), as the former asks it."""
        return self.tokens(PrefillQuery(queued_tokens, n_decode, decode_ctx_tokens, head_tokens, oldest_wait_s))

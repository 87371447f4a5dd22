"""A sequence's token history: what recompute needs, shared by the scheduler's request state and the
in-process engine's sequence.

Both keep the prompt, the tokens generated so far and how many of them sit in a KV cache; a lost
cache costs recomputation from `all_ids`, never the request.
"""

from __future__ import annotations


class TokenHistory:
    """Mixin for a dataclass with `prompt_ids`, `output_ids` and `num_computed` fields."""

    prompt_ids: list[int]
    output_ids: list[int]
    num_computed: int  # tokens whose K/V are in the cache

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending_tokens(self) -> int:
        """Tokens not yet fed to the cache (1 for a sequence in decode)."""
        return self.num_tokens - self.num_computed

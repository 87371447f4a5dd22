"""Prefix caching, the scheduler's side: which content-named KV blocks each attention worker holds, where a
new request goes, and how much of its prompt it starts with.

The attention worker names every full block whose K/V it has computed (`shared.model.block_hash`) and keeps
named blocks after their sequences end, least recently used first, until allocation needs them
(`shared.model.kv_cache`). This index is the scheduler's picture of that: the names of the blocks it has
seen each worker compute, at most as many as the worker has blocks, least recently used dropped first. It
can be wrong only one way: the worker evicted a block the index still lists. The first pass then names the
blocks it expects (`SeqWork.prefix`); a worker that lacks one refuses it (`prefix_missing`), the index
forgets the worker's copy of those names and the request starts again from its first token.

A request takes cached blocks only when nothing it asks needs them computed for it: no prompt logprobs
(they come from the prefill's rows), no repetition penalty (its sampler must see the whole prompt), not a
continuation, not a choice that forks another's prompt. Never the block of the prompt's last token
(`block_hash.reusable_blocks`): its logits are computed by the request itself.
"""

from __future__ import annotations

from collections import OrderedDict

from services.scheduler.state import RequestState
from shared.model.block_hash import block_hashes, name_new_blocks, reusable_blocks


def eligible(state: RequestState) -> bool:
    """Whether `state` may start from cached blocks (module docstring)."""
    return (state.base_tokens == 0 and not state.choice_of and state.sampling.prompt_logprobs is None
            and not state.sampling.has_repetition_penalty)


class PrefixIndex:
    """Per attention worker: the names of the blocks it holds (in use or cached), least recently used first."""

    def __init__(self) -> None:
        self._names: dict[str, OrderedDict[int, None]] = {}

    def prompt_names(self, state: RequestState, block_size: int) -> list[int]:
        """The names of the prompt blocks `state` may take from a cache (none if it is not eligible)."""
        if block_size < 1 or not eligible(state):
            return []
        return block_hashes(state.prompt_ids, block_size, max_blocks=reusable_blocks(len(state.prompt_ids),
                                                                                     block_size))

    def match(self, worker_id: str, names: list[int]) -> int:
        """How many of `names` (a prefix of them) the worker holds."""
        held = self._names.get(worker_id)
        if not held:
            return 0
        n = 0
        for name in names:
            if name not in held:
                break
            n += 1
        return n

    def start(self, worker_id: str, state: RequestState, names: list[int], block_size: int) -> None:
        """`state` is placed on `worker_id` and starts with its first `len(names)` cached blocks."""
        held = self._names.setdefault(worker_id, OrderedDict())
        for name in names:
            held.move_to_end(name)
        state.prefix_names = list(names)
        state.num_computed = len(names) * block_size
        state.cached_tokens = state.num_computed
        state.named_blocks, state.last_block_name = len(names), names[-1] if names else None

    def computed(self, worker_id: str, state: RequestState, block_size: int, capacity_blocks: int) -> None:
        """`state`'s worker has computed its first `num_computed` tokens: their full blocks are named there."""
        if block_size < 1 or state.kv_from is not None or state.fork_from is not None:
            return  # a handed-off or forked KV: the worker did not see its first tokens, and names none
        unnamed = state.all_ids[state.named_blocks * block_size: state.num_computed]  # only the blocks new since
        names, _ = name_new_blocks(unnamed, block_size, state.last_block_name)
        if not names:
            return
        held = self._names.setdefault(worker_id, OrderedDict())
        for name in names:
            held[name] = None
            held.move_to_end(name)
        state.named_blocks, state.last_block_name = state.named_blocks + len(names), names[-1]
        while capacity_blocks > 0 and len(held) > capacity_blocks:
            held.popitem(last=False)

    def missing(self, worker_id: str, names: list[int]) -> None:
        """The worker lacked some of `names`: forget its copy of all of them."""
        held = self._names.get(worker_id, OrderedDict())
        for name in names:
            held.pop(name, None)

    def lost(self, worker_id: str) -> None:
        """The worker is gone or restarted: its KV with it."""
        self._names.pop(worker_id, None)

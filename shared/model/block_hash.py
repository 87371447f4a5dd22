"""Content names of KV blocks for prefix caching: vLLM's chained block hashes, the same in every process.

A full block of `block_size` tokens is named by a hash of its parent block's name and its own token ids,
so equal names mean equal tokens at equal positions from the start of the sequence: the block's K/V are
the same whichever request computed them. Only full blocks are named (a partial block is still being
written). blake2b over the little-endian int64 token ids: Python's `hash` is salted per process, and the
scheduler and the attention workers must agree on a name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def block_hashes(token_ids: Sequence[int], block_size: int, *, max_blocks: int | None = None,
                 parent: int | None = None) -> list[int]:
    """The names of the full blocks of `token_ids`, first block first (at most `max_blocks` of them);
    `parent`: the name of the block before them (the tokens go on a sequence whose earlier blocks are named)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        n_blocks = min(n_blocks, max(0, max_blocks))
    ids = np.asarray(token_ids[: n_blocks * block_size], dtype="<i8").reshape(n_blocks, block_size)
    out: list[int] = []
    chain = b"" if parent is None else parent.to_bytes(8, "little")
    for row in ids:
        chain = hashlib.blake2b(chain + row.tobytes(), digest_size=8).digest()
        out.append(int.from_bytes(chain, "little"))
    return out


def name_new_blocks(unnamed: Sequence[int], block_size: int, parent: int | None) -> tuple[list[int], int]:
    """The names of the blocks that `unnamed` fills, and how many of its tokens they take (the rest wait for
    their block to fill). `unnamed`: a sequence's tokens after its last named block, whose name is `parent`.

    The one naming step of both sides of prefix caching (the attention worker's, over the tokens each pass
    commits; the scheduler's index, over the tokens it knows computed): a name that drifts between them
    costs a recompute no one sees."""
    names = block_hashes(unnamed, block_size, parent=parent)
    return names, len(names) * block_size


def reusable_blocks(prompt_len: int, block_size: int) -> int:
    """How many of a prompt's full blocks a new request may take from the cache: never the block of the
    prompt's last token, whose logits the request must compute itself (so a cached block is never written)."""
    return max(0, (prompt_len - 1) // block_size)

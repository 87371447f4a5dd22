"""Prefix caching in the KV bookkeeping: content names that agree across processes, blocks kept after their
sequences end and taken by later prompts with the same prefix, evicted least recently used first and never
while a sequence holds them; checked against a model of the rule over random operation sequences."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys

import pytest

from shared.errors import KVCacheExhaustedError
from shared.model.block_hash import block_hashes, name_new_blocks, reusable_blocks
from shared.model.kv_cache import BlockAllocator, BlockTables
from tests.conftest import REPO_ROOT


def test_names_chain_the_prefix_and_agree_across_processes() -> None:
    a = block_hashes(list(range(10)), 4)
    assert len(a) == 2  # full blocks only
    assert block_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4)[0] == a[0]
    assert block_hashes([7, 1, 2, 3, 4, 5, 6, 7], 4)[1] != a[1]  # same tokens, other prefix: another name
    assert block_hashes(list(range(10)), 4, max_blocks=1) == a[:1]
    code = "from shared.model.block_hash import block_hashes; print(block_hashes(list(range(10)), 4))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123"}, cwd=REPO_ROOT)
    assert other.stdout.strip() == str(a)
    assert [reusable_blocks(n, 4) for n in (1, 4, 5, 8, 9)] == [0, 0, 1, 1, 2]  # never the last token's block
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)


def _worker_names(chunks: list[list[int]], block_size: int) -> list[int]:
    """The attention worker's path: each committed pass's tokens join an unnamed tail, its full blocks named."""
    names: list[int] = []
    unnamed: list[int] = []
    for chunk in chunks:
        unnamed += chunk
        new, used = name_new_blocks(unnamed, block_size, names[-1] if names else None)
        names += new
        del unnamed[:used]
    return names


def _scheduler_names(chunks: list[list[int]], block_size: int) -> list[int]:
    """The scheduler's path: after each pass, the tokens computed past its last named block, sliced from the
    whole history."""
    names: list[int] = []
    history: list[int] = []
    for chunk in chunks:
        history += chunk
        new, _ = name_new_blocks(history[len(names) * block_size:], block_size, names[-1] if names else None)
        names += new
    return names


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_both_sides_name_the_same_blocks_however_the_tokens_are_chunked(block_size: int) -> None:
    """The worker and the scheduler name a sequence's blocks from differently kept tokens; any drift between
    them is a recompute no one sees, so every chunking must give both the names of the whole sequence."""
    rng = random.Random(block_size)
    tokens = [rng.randrange(1000) for _ in range(5 * block_size + 3)]
    whole = block_hashes(tokens, block_size)
    cuts_by_case = [[], [1], [block_size], [block_size - 1, block_size + 1], list(range(1, len(tokens))),
                    sorted(rng.sample(range(1, len(tokens)), 4))]
    for cuts in cuts_by_case:
        bounds = [0, *cuts, len(tokens)]
        chunks = [tokens[a:b] for a, b in itertools.pairwise(bounds) if b > a]
        assert _worker_names(chunks, block_size) == _scheduler_names(chunks, block_size) == whole, cuts
    names, used = name_new_blocks(tokens[: 2 * block_size + block_size // 2], block_size, None)
    assert names == whole[:2] and used == 2 * block_size  # the partial block's tokens wait
    assert name_new_blocks(tokens[: block_size - 1], block_size, whole[0]) == ([], 0)  # no block full yet


def cached(alloc: BlockAllocator, names: list[int]) -> list[int]:
    """The blocks of the longest prefix of `names` that no table holds: kept only for a later prompt."""
    return [b for b in alloc.lookup(names) if alloc.refs(b) == 0]


def test_a_later_prompt_takes_the_cached_blocks_and_eviction_is_lru() -> None:
    tables = BlockTables(BlockAllocator(6, 4))
    alloc = tables.allocator
    prompt = list(range(12))
    names = block_hashes(prompt, 4)
    tables.add_sequence("a")
    tables.reserve("a", 13)  # 4 blocks
    tables.name_blocks("a", names)
    a_blocks = tables.block_table("a")
    tables.free_sequence("a")
    assert cached(alloc, names) == a_blocks[:3] and alloc.num_free_blocks == 6  # cached blocks still count as room
    assert tables.add_cached_sequence("b", block_hashes([*prompt[:8], 99, 99, 99, 99], 4)) == 8
    assert tables.block_table("b") == a_blocks[:2] and cached(alloc, names) == a_blocks[2:3]
    tables.reserve("b", 13)
    # a new sequence needing every free block evicts the one cached block b does not hold
    tables.add_sequence("c")
    tables.reserve("c", 4 * alloc.num_free_blocks)
    assert alloc.evictions == 1 and alloc.lookup(names) == a_blocks[:2]
    with pytest.raises(KVCacheExhaustedError):
        tables.reserve("c", 4 * 10)
    tables.free_sequence("b")
    assert tables.add_cached_sequence("d", names) == 8  # b's blocks came back to the cache, not the free list


def test_random_operations_match_the_rule() -> None:
    """Every step checked against a plain model: free + cached = room; cached blocks are those named and
    held by no table; a sequence's blocks are never handed to another; eviction takes the oldest cached."""
    rng = random.Random(7)
    bs, n = 2, 12
    tables = BlockTables(BlockAllocator(n, bs))
    alloc = tables.allocator
    prompts = [[rng.randrange(3) for _ in range(8)] for _ in range(6)]
    live: dict[str, list[int]] = {}
    for step in range(400):
        op = rng.random()
        if op < 0.5 and len(live) < 5:
            sid, prompt = f"s{step}", rng.choice(prompts)
            names = block_hashes(prompt, bs, max_blocks=reusable_blocks(len(prompt), bs))
            expect = len(alloc.lookup(names)) * bs
            try:
                got = tables.add_cached_sequence(sid, names)
                tables.reserve(sid, len(prompt) + 1)
            except KVCacheExhaustedError:
                tables.free_sequence(sid)
                continue
            assert got == expect
            tables.name_blocks(sid, block_hashes(prompt, bs))
            live[sid] = prompt
        elif live:
            sid = rng.choice(sorted(live))
            tables.free_sequence(sid)
            del live[sid]
        held = [b for s in live for b in tables.block_table(s)]
        assert alloc.num_free_blocks == n - len(set(held))
        assert all(alloc.refs(b) == held.count(b) for b in set(held))
        kept = {b for prompt in prompts for b in cached(alloc, block_hashes(prompt, bs))}
        assert kept.isdisjoint(held) and len(kept) <= n - len(set(held))
    assert alloc.evictions > 0  # the run was tight enough to evict

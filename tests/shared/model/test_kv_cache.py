"""Paged KV cache bookkeeping: a block must never serve two sequences, and slots must never move."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from shared.errors import KVCacheExhaustedError
from shared.model.kv_cache import BlockAllocator, BlockTables


def test_allocate_is_all_or_nothing() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=16)
    assert alloc.allocate(3) == [0, 1, 2]
    with pytest.raises(KVCacheExhaustedError) as info:
        alloc.allocate(2)
    assert (info.value.needed_blocks, info.value.free_blocks) == (2, 1)
    assert alloc.num_free_blocks == 1
    assert alloc.allocate(0) == []
    assert alloc.allocate(1) == [3]


def test_free_rejects_double_free_and_foreign_ids_without_changing_anything() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=8)
    blocks = alloc.allocate(2)
    alloc.free([blocks[0]])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([blocks[1], blocks[0]])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([blocks[1], blocks[1]])
    with pytest.raises(ValueError, match="does not belong"):
        alloc.free([blocks[1], 4])
    with pytest.raises(ValueError, match="does not belong"):
        alloc.free([-1])
    assert alloc.num_free_blocks == 3  # the failed calls freed nothing
    alloc.free([blocks[1]])
    assert alloc.num_free_blocks == 4


def test_invalid_allocator_arguments() -> None:
    with pytest.raises(ValueError):
        BlockAllocator(num_blocks=4, block_size=0)
    with pytest.raises(ValueError):
        BlockAllocator(num_blocks=-1, block_size=4)
    with pytest.raises(ValueError):
        BlockAllocator(num_blocks=4, block_size=4).allocate(-1)


def test_slots_follow_block_table_across_block_boundaries() -> None:
    tables = BlockTables(BlockAllocator(num_blocks=8, block_size=4))
    tables.add_sequence("a")
    tables.add_sequence("b")
    tables.reserve("a", 3)
    tables.reserve("b", 4)
    tables.reserve("a", 9)  # a: blocks [0, 2, 3]
    assert tables.block_table("a") == [0, 2, 3]
    assert len(tables.slots("a", 0, 12)) == 12  # the capacity: three blocks of four
    with pytest.raises(ValueError, match="reserved capacity of 12 tokens"):
        tables.slots("a", 0, 13)
    assert tables.slots("a", 0, 9) == [0, 1, 2, 3, 8, 9, 10, 11, 12]
    assert tables.slots("a", 5, 1) == [9]
    assert tables.slots("a", 3, 0) == []
    assert tables.slots("b", 0, 4) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="outside"):
        tables.slots("a", 10, 3)
    with pytest.raises(ValueError, match="outside"):
        tables.slots("b", 4, 1)


def test_block_table_is_a_copy_and_unknown_sequences_raise() -> None:
    tables = BlockTables(BlockAllocator(num_blocks=2, block_size=4))
    tables.add_sequence("a")
    tables.reserve("a", 4)
    tables.block_table("a").append(99)
    assert tables.block_table("a") == [0]
    with pytest.raises(ValueError, match="already"):
        tables.add_sequence("a")
    with pytest.raises(KeyError, match="unknown sequence"):
        tables.reserve("zz", 1)
    with pytest.raises(KeyError, match="unknown sequence"):
        tables.free_sequence("zz")


def test_blocks_needed_and_what_reserve_can_take() -> None:
    tables = BlockTables(BlockAllocator(num_blocks=3, block_size=4))
    assert tables.blocks_needed(None, 0) == 0
    assert tables.blocks_needed(None, 9) == 3
    assert tables.blocks_needed(None, 12) <= tables.allocator.num_free_blocks < tables.blocks_needed(None, 13)
    tables.add_sequence("a")
    with pytest.raises(KVCacheExhaustedError):  # a new sequence of 13 tokens does not fit
        tables.reserve("a", 13)
    tables.reserve("a", 5)
    assert tables.blocks_needed("a", 8) == 0
    assert tables.blocks_needed("a", 3) == 0  # never shrinks
    assert tables.blocks_needed("a", 9) == 1
    with pytest.raises(KVCacheExhaustedError):
        tables.reserve("a", 13)
    tables.reserve("a", 12)  # a's two blocks and the last free one
    assert tables.allocator.num_free_blocks == 0


def test_exhaustion_leaves_table_and_allocator_unchanged_then_free_returns_all() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    tables = BlockTables(alloc)
    tables.add_sequence("a")
    tables.add_sequence("b")
    tables.reserve("a", 5)
    with pytest.raises(KVCacheExhaustedError):
        tables.reserve("b", 3)
    assert tables.block_table("b") == []
    assert alloc.num_free_blocks == 1
    tables.free_sequence("a")
    assert alloc.num_free_blocks == 4
    assert tables.sequences() == ["b"]
    assert not tables.has_sequence("a")


class PagedCacheMachine(RuleBasedStateMachine):
    """Random interleavings of add / reserve / free against a model of what each sequence owns."""

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(num_blocks=12, block_size=3)
        self.tables = BlockTables(self.alloc)
        self.reserved_tokens: dict[str, int] = {}  # model: the largest reserve() that succeeded
        self.known_slots: dict[str, list[int]] = {}  # slots seen so far, must never change
        self.counter = 0

    @rule(target=seqs)
    def add(self) -> str:
        seq_id = f"s{self.counter}"
        self.counter += 1
        self.tables.add_sequence(seq_id)
        self.reserved_tokens[seq_id] = 0
        self.known_slots[seq_id] = []
        return seq_id

    @rule(seq_id=seqs, extra_tokens=st.integers(0, 20))
    def reserve(self, seq_id: str, extra_tokens: int) -> None:
        if not self.tables.has_sequence(seq_id):
            return
        total = self.reserved_tokens[seq_id] + extra_tokens
        free_before = self.alloc.num_free_blocks
        table_before = self.tables.block_table(seq_id)
        needed = self.tables.blocks_needed(seq_id, total)
        try:
            self.tables.reserve(seq_id, total)
        except KVCacheExhaustedError as exc:  # exactly when it needs more blocks than are free
            assert needed > free_before
            assert (exc.needed_blocks, exc.free_blocks) == (needed, free_before)
            assert self.tables.block_table(seq_id) == table_before
            assert self.alloc.num_free_blocks == free_before
            return
        assert needed <= free_before and self.alloc.num_free_blocks == free_before - needed
        assert self.tables.block_table(seq_id)[: len(table_before)] == table_before
        assert len(self.tables.slots(seq_id, 0, total)) == total  # within the capacity now
        self.reserved_tokens[seq_id] = max(self.reserved_tokens[seq_id], total)
        slots = self.tables.slots(seq_id, 0, self.reserved_tokens[seq_id])
        old = self.known_slots[seq_id]
        assert slots[: len(old)] == old  # growing never moves a token
        self.known_slots[seq_id] = slots

    @rule(seq_id=consumes(seqs))
    def free(self, seq_id: str) -> None:
        free_before = self.alloc.num_free_blocks
        n_blocks = len(self.tables.block_table(seq_id))
        self.tables.free_sequence(seq_id)
        assert self.alloc.num_free_blocks == free_before + n_blocks
        del self.reserved_tokens[seq_id]
        del self.known_slots[seq_id]

    @rule(seq_id=seqs, data=st.data())
    def slot_window_matches_whole(self, seq_id: str, data: st.DataObject) -> None:
        if not self.tables.has_sequence(seq_id):
            return
        cap = len(self.tables.block_table(seq_id)) * self.alloc.block_size
        start = data.draw(st.integers(0, cap))
        count = data.draw(st.integers(0, cap - start))
        whole = self.tables.slots(seq_id, 0, cap)
        assert self.tables.slots(seq_id, start, count) == whole[start:start + count]

    @invariant()
    def blocks_are_owned_once_and_conserved(self) -> None:
        owned = [b for s in self.tables.sequences() for b in self.tables.block_table(s)]
        assert len(owned) == len(set(owned))
        assert all(0 <= b < self.alloc.num_blocks for b in owned)
        assert len(owned) + self.alloc.num_free_blocks == self.alloc.num_blocks

    @invariant()
    def slots_of_different_sequences_never_overlap(self) -> None:
        all_slots: list[int] = []
        for s in self.tables.sequences():
            all_slots.extend(self.tables.slots(s, 0, len(self.tables.block_table(s)) * self.alloc.block_size))
        assert len(all_slots) == len(set(all_slots))
        assert all(0 <= x < self.alloc.num_blocks * self.alloc.block_size for x in all_slots)


TestPagedCacheMachine = PagedCacheMachine.TestCase
TestPagedCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(block_size=st.integers(1, 8), total=st.integers(0, 60), data=st.data())
@settings(max_examples=100, deadline=None)
def test_slots_equal_per_token_formula(block_size: int, total: int, data: st.DataObject) -> None:
    tables = BlockTables(BlockAllocator(num_blocks=128, block_size=block_size))
    tables.add_sequence("other")
    tables.add_sequence("x")
    # Interleave growth so x's blocks are not contiguous.
    for step in range(1, total + 1):
        tables.reserve("x", step)
        tables.reserve("other", step)
    table = tables.block_table("x")
    start = data.draw(st.integers(0, total))
    count = data.draw(st.integers(0, total - start))
    expected = [table[p // block_size] * block_size + p % block_size for p in range(start, start + count)]
    assert tables.slots("x", start, count) == expected


def test_fork_shares_the_prefix_and_copy_on_write_gives_each_writer_its_own_block() -> None:
    """A 10-token prompt in blocks of 4: a child forked at 9 tokens shares blocks 0-2; writing position
    9 copies block 2 (shared, partly filled) for the writer only; the parent then owns block 2 alone."""
    tables = BlockTables(BlockAllocator(8, 4))
    tables.add_sequence("parent")
    tables.reserve("parent", 10)
    assert tables.block_table("parent") == [0, 1, 2] and tables.allocator.num_free_blocks == 5
    tables.fork("parent", "child", 9)
    assert tables.block_table("child") == [0, 1, 2] and tables.allocator.num_free_blocks == 5  # nothing new
    tables.reserve("child", 10)
    assert tables.copy_on_write("child", 9, 10) == [(2, 3)]  # the storage copies block 2 into 3
    assert tables.block_table("child") == [0, 1, 3] and tables.allocator.refs(2) == 1
    assert tables.copy_on_write("parent", 10, 12) == []  # block 2 is the parent's alone again
    assert tables.copy_on_write("child", 0, 4) == [(0, 4)]  # a write into the shared prefix copies too
    tables.free_sequence("parent")
    assert tables.allocator.num_free_blocks == 5  # blocks 0 and 2 came back; 1 is still the child's
    assert tables.allocator.refs(1) == 1
    tables.free_sequence("child")
    assert tables.allocator.num_free_blocks == 8


def test_fork_and_copy_on_write_refuse_what_they_cannot_do() -> None:
    tables = BlockTables(BlockAllocator(3, 4))
    tables.add_sequence("a")
    tables.reserve("a", 12)  # every block
    with pytest.raises(ValueError, match="cannot fork"):
        tables.fork("a", "b", 13)
    tables.fork("a", "b", 12)
    with pytest.raises(KVCacheExhaustedError):
        tables.copy_on_write("b", 0, 12)
    assert tables.block_table("b") == [0, 1, 2] and tables.allocator.refs(0) == 2  # unchanged
    with pytest.raises(ValueError, match="already has"):
        tables.fork("a", "b", 4)
    assert tables.allocator.num_shared_blocks == 3

"""Bookkeeping of the paged KV cache: which blocks are free and which blocks hold which sequence.

The tensor storage lives elsewhere and keeps K/V in one flat slot dimension, where
`slot = block_id * block_size + offset`. This module only hands out block ids and turns token
positions into slot ids, so it is pure Python: it runs on the decode hot path once per step for
every sequence, and a list plus range arithmetic is cheaper there than any tensor op.

Blocks are reference-counted so that sequences can share a prefix (`fork`: the n choices of one
request share their prompt's KV). A shared block is copied before anyone writes to it
(`copy_on_write` names the copies the storage must make), so a sequence's K/V never change under it.

Prefix caching: a full block can be named by its content (`cache`, with a `block_hash` name). A named
block that no sequence holds any more is not freed but kept, least recently used first, and a later
sequence whose prompt starts with the same blocks takes them (`BlockTables.add_cached_sequence`)
instead of computing them again; allocation evicts the least recently used of them when no free block
is left. So cached blocks count as free capacity, and nothing a sequence holds is ever evicted.
"""

from __future__ import annotations

from collections import OrderedDict

from shared.errors import KVCacheExhaustedError


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockAllocator:
    """A free list of `num_blocks` KV blocks of `block_size` token slots each.

    `allocate` is all-or-nothing so that a failed grow never leaves a sequence half-extended; the
    scheduler catches `KVCacheExhaustedError` and preempts or queues instead.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        # Reversed so that pop() hands out low ids first: easier to read in logs and tests.
        self._free_stack: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs: list[int] = [0] * num_blocks  # 0: free or cached; >1: shared by that many tables
        self.num_shared_blocks = 0  # blocks held by more than one table (0: nothing to copy on write)
        self._name_of: dict[int, int] = {}  # block -> content name (a full block whose K/V are written)
        self._block_of: dict[int, int] = {}  # content name -> block
        self._cached: OrderedDict[int, None] = OrderedDict()  # named blocks no table holds, least recent first
        self.evictions = 0  # cached blocks taken back for new work

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take: free ones, and cached ones no table holds (evicted as needed)."""
        return len(self._free_stack) + len(self._cached)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks, or none at all (raises `KVCacheExhaustedError(n, free)`); free blocks first,
        then the least recently used cached ones, which lose their names."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        free = len(self._free_stack)
        if n > free + len(self._cached):
            raise KVCacheExhaustedError(n, free + len(self._cached))
        if n == 0:
            return []
        take = min(n, free)
        blocks = self._free_stack[free - take:]
        del self._free_stack[free - take:]
        blocks.reverse()  # pop order: lowest id first
        for _ in range(n - take):
            b, _none = self._cached.popitem(last=False)
            del self._block_of[self._name_of.pop(b)]
            self.evictions += 1
            blocks.append(b)
        refs = self._refs
        for b in blocks:
            refs[b] = 1
        return blocks

    def cache(self, block: int, name: int) -> None:
        """Name a held, full block by its content (`block_hash`); a name another block has already stays there."""
        self._check([block])
        if name not in self._block_of and block not in self._name_of:
            self._name_of[block] = name
            self._block_of[name] = block

    def lookup(self, names: list[int]) -> list[int]:
        """The blocks holding the longest prefix of `names` (held by tables or cached)."""
        out = []
        for name in names:
            b = self._block_of.get(name)
            if b is None:
                break
            out.append(b)
        return out

    def take(self, blocks: list[int]) -> None:
        """One more table holds each of these named blocks, cached or already held."""
        for b in blocks:
            if b not in self._name_of:
                raise ValueError(f"KV block {b} holds no cached content to take")
        for b in blocks:
            if self._refs[b] == 0:
                del self._cached[b]
            self._refs[b] += 1
            self.num_shared_blocks += self._refs[b] == 2

    def refs(self, block: int) -> int:
        return self._refs[block]

    def share(self, blocks: list[int]) -> None:
        """One more table holds each of `blocks` (all in use)."""
        self._check(blocks)
        for b in blocks:
            self._refs[b] += 1
            self.num_shared_blocks += self._refs[b] == 2

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each of `blocks`; a block nobody holds returns to the free list.
        Checks every id first so that a bad call changes nothing.

        A double free or an id this allocator never owned is a bookkeeping bug that would later hand
        one block to two sequences (silently mixing their KV), so it raises `ValueError` at once.
        """
        self._check(blocks)
        refs = self._refs
        released = []
        for b in blocks:
            refs[b] -= 1
            self.num_shared_blocks -= refs[b] == 1
            if refs[b] == 0:
                if b in self._name_of:
                    self._cached[b] = None  # kept for a later prompt: the most recently used
                else:
                    released.append(b)
        self._free_stack.extend(reversed(released))

    def _check(self, blocks: list[int]) -> None:
        seen: set[int] = set()
        for b in blocks:
            if not (isinstance(b, int) and 0 <= b < self._num_blocks):
                raise ValueError(f"block id {b!r} does not belong to this allocator "
                                 f"(valid ids: 0..{self._num_blocks - 1})")
            if self._refs[b] == 0 or b in seen:
                raise ValueError(f"double free of KV block {b} (it is not in use, or named twice)")
            seen.add(b)


class BlockTables:
    """Per-sequence block tables on top of one `BlockAllocator`.

    A sequence's table only ever grows at the end (until `free_sequence`), so the slot of a token
    position never changes once reserved: K/V written at a step stay valid for every later step.
    """

    def __init__(self, allocator: BlockAllocator) -> None:
        self._allocator = allocator
        self._block_size = allocator.block_size
        self._tables: dict[str, list[int]] = {}

    @property
    def allocator(self) -> BlockAllocator:
        return self._allocator

    @property
    def block_size(self) -> int:
        return self._block_size

    def _table(self, seq_id: str) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def fork(self, parent: str, child: str, num_tokens: int) -> None:
        """A new table for `child` that shares `parent`'s blocks holding its first `num_tokens` tokens."""
        table = self._table(parent)
        if child in self._tables:
            raise ValueError(f"sequence {child!r} already has a block table")
        n_blocks = _ceil_div(num_tokens, self._block_size)
        if num_tokens < 0 or n_blocks > len(table):
            raise ValueError(f"cannot fork {num_tokens} tokens of sequence {parent!r}: it holds "
                             f"{len(table) * self._block_size}")
        shared = table[:n_blocks]
        self._allocator.share(shared)
        self._tables[child] = list(shared)

    def copy_on_write(self, seq_id: str, start: int, end: int) -> list[tuple[int, int]]:
        """Before writing positions [start, end): give the sequence its own copy of every shared block
        in that range. Returns (source, destination) block ids whose contents the storage must copy.
        Atomic: on `KVCacheExhaustedError` nothing changed."""
        table = self._table(seq_id)
        if not self._allocator.num_shared_blocks:  # the common case: nothing is shared
            return []
        bs = self._block_size
        shared = [i for i in range(start // bs, min(_ceil_div(end, bs), len(table)))
                  if self._allocator.refs(table[i]) > 1]
        if not shared:
            return []
        fresh = self._allocator.allocate(len(shared))
        copies = []
        for i, new in zip(shared, fresh, strict=True):
            copies.append((table[i], new))
            self._allocator.free([table[i]])  # one reference fewer: the other holders keep it
            table[i] = new
        return copies

    def add_sequence(self, seq_id: str) -> None:
        """Register a sequence with an empty table; reserve capacity with `reserve`."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        self._tables[seq_id] = []

    def add_cached_sequence(self, seq_id: str, names: list[int]) -> int:
        """Register a sequence whose table starts with the cached blocks of the longest prefix of `names`
        (`block_hash.block_hashes` of its prompt); returns how many of its tokens they hold."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        blocks = self._allocator.lookup(names)
        self._allocator.take(blocks)
        self._tables[seq_id] = blocks
        return len(blocks) * self._block_size

    def name_blocks(self, seq_id: str, names: list[int], first_block: int = 0) -> None:
        """Name the sequence's blocks from `first_block` on by their content (their K/V are written and
        full), so later prompts with the same prefix can take them."""
        table = self._table(seq_id)
        for block, name in zip(table[first_block:], names, strict=False):
            self._allocator.cache(block, name)

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def sequences(self) -> list[str]:
        return list(self._tables)

    def block_table(self, seq_id: str) -> list[int]:
        """A copy of the sequence's block ids, in token order (callers may keep or mutate it)."""
        return list(self._table(seq_id))

    def blocks_needed(self, seq_id: str | None, total_tokens: int) -> int:
        """Extra blocks a sequence (or a new one, for `None`) needs to hold `total_tokens` tokens."""
        if total_tokens < 0:
            raise ValueError(f"total_tokens must be >= 0, got {total_tokens}")
        have = 0 if seq_id is None else len(self._table(seq_id))
        return max(0, _ceil_div(total_tokens, self._block_size) - have)

    def reserve(self, seq_id: str, total_tokens: int) -> None:
        """Grow the table so the sequence can hold `total_tokens` tokens; never shrinks it.

        Atomic: on `KVCacheExhaustedError` the table and the allocator are unchanged.
        """
        needed = self.blocks_needed(seq_id, total_tokens)
        if needed:
            self._table(seq_id).extend(self._allocator.allocate(needed))

    def slots(self, seq_id: str, start: int, count: int) -> list[int]:
        """Flat slot ids of token positions [start, start + count), within the reserved capacity."""
        table = self._table(seq_id)
        bs = self._block_size
        end = start + count
        if start < 0 or count < 0 or end > len(table) * bs:
            raise ValueError(f"token positions [{start}, {end}) of sequence {seq_id!r} are outside "
                             f"its reserved capacity of {len(table) * bs} tokens")
        if count == 1:  # decode: one token, no loop
            return [table[start // bs] * bs + start % bs]
        out: list[int] = []
        pos = start
        while pos < end:
            block_index, offset = divmod(pos, bs)
            run = min(bs - offset, end - pos)
            base = table[block_index] * bs + offset
            out.extend(range(base, base + run))
            pos += run
        return out

    def free_sequence(self, seq_id: str) -> None:
        """Return all of the sequence's blocks to the allocator and forget the sequence."""
        table = self._table(seq_id)
        self._allocator.free(table)
        del self._tables[seq_id]

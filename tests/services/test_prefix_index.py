"""Prefix caching's two sides without a mesh: the attention worker names the blocks a committed pass wrote and
refuses a first pass whose cached blocks are gone; the scheduler's index learns what each worker computed,
routes a prompt to its longest cached prefix, and forgets a worker's copy when told it is missing."""

from __future__ import annotations

import itertools

import pytest

from services.attention_worker.sequences import Admitted, SequenceRefused, SequenceTable
from services.scheduler.prefix_index import PrefixIndex, eligible
from services.scheduler.state import RequestState
from shared.error_types import PREFIX_MISSING
from shared.messages import SamplingSpec, SeqWork
from shared.model.block_hash import block_hashes
from shared.model.kv_cache import BlockAllocator, BlockTables

BS = 4
PROMPT = list(range(1, 15))  # 14 tokens: 3 full blocks, the last token's block not reusable


def _table(n_blocks: int = 16) -> SequenceTable:
    return SequenceTable(BlockTables(BlockAllocator(n_blocks, BS)), eos_token_ids=(0,), vocab_size=50,
                         max_seq_len=512)


def _run(table: SequenceTable, work: SeqWork) -> Admitted:
    """Admit and commit a pass as the worker does after a forward that succeeded."""
    item = table.admit(work)
    item.state.num_computed = item.end
    table.name_computed([item])
    return item


def test_the_worker_names_what_it_computed_and_a_later_prompt_starts_from_it() -> None:
    table = _table()
    spec = SamplingSpec(max_tokens=4)
    _run(table, SeqWork(seq_id="a", token_ids=PROMPT[:6], start_pos=0, sample=False, sampling=spec))
    _run(table, SeqWork(seq_id="a", token_ids=PROMPT[6:], start_pos=6, sample=True))
    names = block_hashes(PROMPT, BS)
    assert table.block_tables.allocator.lookup(names) == table.block_tables.block_table("a")[:3]
    table.free("a")
    reused = names[:2]  # (14 - 1) // 4 = 3 blocks may be taken; the scheduler asks for 2 here
    b = table.admit(SeqWork(seq_id="b", token_ids=PROMPT[8:], start_pos=8, sample=True, sampling=spec,
                            prefix=reused))
    assert b.state.num_computed == 8 and b.seq_pass.start_pos == 8
    with pytest.raises(SequenceRefused) as info:  # a block it names was never here
        table.admit(SeqWork(seq_id="c", token_ids=[9], start_pos=4, sample=True, sampling=spec, prefix=[12345]))
    assert info.value.code == PREFIX_MISSING and "c" not in table and not table.block_tables.has_sequence("c")


def test_the_index_routes_by_longest_prefix_and_forgets_what_was_missing() -> None:
    index = PrefixIndex()
    a = RequestState("a", PROMPT, SamplingSpec(max_tokens=4), 0.0)
    names = index.prompt_names(a, BS)
    assert len(names) == 3
    a.num_computed = len(PROMPT)
    index.computed("w1", a, BS, capacity_blocks=64)
    assert index.match("w1", names) == 3 and index.match("w2", names) == 0
    b = RequestState("b", [*PROMPT[:8], 40, 41, 42, 43, 44], SamplingSpec(max_tokens=4), 0.0)
    held = index.match("w1", index.prompt_names(b, BS))
    assert held == 2
    index.start("w1", b, index.prompt_names(b, BS)[:held], BS)
    assert (b.num_computed, b.cached_tokens, b.prefix_names) == (8, 8, names[:2])
    index.missing("w1", names[:2])
    assert index.match("w1", names) == 0
    # a small capacity keeps the most recent names only
    again = RequestState("again", PROMPT, SamplingSpec(max_tokens=4), 0.0)
    again.num_computed = len(PROMPT)
    index.computed("w3", again, BS, capacity_blocks=2)
    assert index.match("w3", names) == 0 and index.match("w3", names[1:]) == 2
    assert not eligible(RequestState("p", PROMPT, SamplingSpec(max_tokens=4, prompt_logprobs=1), 0.0))
    assert not eligible(RequestState("r", PROMPT, SamplingSpec(max_tokens=4, repetition_penalty=1.2), 0.0))


@pytest.mark.parametrize("cuts", [[], [1], [BS], [BS - 1, BS + 1], list(range(1, len(PROMPT)))])
def test_the_worker_and_the_index_name_the_same_blocks_however_the_passes_chunk(cuts: list[int]) -> None:
    """The worker names blocks from the tokens each pass commits, the scheduler from the whole history it keeps:
    the same names for every chunking of the prompt and the decode after it (a drift is a silent recompute)."""
    decode = [21, 22, 23, 24, 25]  # the prompt's tail and these fill blocks 3 and 4
    table, index = _table(), PrefixIndex()
    req = RequestState("s", PROMPT, SamplingSpec(max_tokens=8), 0.0)
    bounds = [0, *cuts, len(PROMPT)]
    passes = [(PROMPT[a:b], a, b == len(PROMPT)) for a, b in itertools.pairwise(bounds) if b > a]
    passes += [([tok], len(PROMPT) + i, True) for i, tok in enumerate(decode)]
    for n, (tokens, start, sample) in enumerate(passes):
        item = _run(table, SeqWork(seq_id="s", token_ids=tokens, start_pos=start, sample=sample,
                                   sampling=req.sampling if n == 0 else None))
        req.output_ids = decode[: max(0, start + len(tokens) - len(PROMPT))]
        req.num_computed = start + len(tokens)
        index.computed("w", req, BS, capacity_blocks=64)
        assert (item.state.named_blocks, item.state.last_name) == (req.named_blocks, req.last_block_name)
    names = block_hashes([*PROMPT, *decode], BS)
    assert len(names) == 4 and req.named_blocks == 4 and index.match("w", names) == 4
    assert table.block_tables.allocator.lookup(names) == table.block_tables.block_table("s")[:4]

"""The KV handoff's worker side (services/attention_worker/kv_handoff.py): a sequence's KV leaves one
attention worker's cache over a real torch seam and lands, row for row, in fresh blocks of another's.

Two `KVHandoffs` in this process, each with a real `TorchSeam` (gloo over loopback), the receiver
listening as an attention worker's KV seam does; their caches are `PagedKVStore`s of random K/V.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.attention_worker.kv_handoff import KVHandoffError, KVHandoffs, pack, unpack
from services.attention_worker.sequences import SequenceRefused, SequenceTable
from shared.messages import KVHandoff, SeqWork
from shared.model.attention import PagedKVStore
from shared.model.kv_cache import BlockAllocator, BlockTables
from shared.model.params import SamplingParams
from shared.transport.torch_seam import TorchSeam


class Shape:
    n_layers, n_kv_heads, head_dim = 3, 2, 8


def _store(n_blocks: int, block_size: int) -> PagedKVStore:
    kv = PagedKVStore(Shape, n_blocks * block_size, torch.float32, torch.device("cpu"))  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(n_blocks)
    for cache in (*kv.k, *kv.v):
        cache.copy_(torch.randn(cache.shape, generator=generator))
    return kv


def _table(n_blocks: int, block_size: int) -> SequenceTable:
    return SequenceTable(BlockTables(BlockAllocator(n_blocks, block_size)), eos_token_ids=(0,), vocab_size=50,
                         max_seq_len=512)


def _rows(kv: PagedKVStore, slots: list[int]) -> torch.Tensor:
    index = torch.tensor(slots)
    return torch.stack([cache[index] for cache in (*kv.k, *kv.v)])  # [2L, n, Hkv, hd]


def _work(seq_id: str, start_pos: int, token_ids: list[int], kv_from: str | None = None) -> SeqWork:
    return SeqWork(seq_id=seq_id, token_ids=token_ids, start_pos=start_pos, sample=True,
                   sampling=SamplingParams(max_tokens=8, temperature=0.0), generated_ids=[3], kv_from=kv_from)


def test_pack_then_unpack_moves_every_row_into_other_blocks() -> None:
    source, target = _store(16, 4), _store(32, 4)
    blocks, n = [5, 2, 9], 10  # the last block holds 2 of its 4 slots
    slots = [b * 4 + o for b in blocks for o in range(4)][:n]
    tensor = pack(source, blocks, 4, n)
    assert tensor.shape == (6, 12, 2, 8) and tensor.is_contiguous()  # whole blocks
    assert torch.equal(tensor[:, :n], _rows(source, slots))
    their_slots = list(range(40, 40 + n))
    unpack(target, their_slots, tensor)
    assert torch.equal(_rows(target, their_slots), _rows(source, slots))
    with pytest.raises(KVHandoffError, match="does not fit"):
        unpack(target, list(range(13)), tensor)


def test_adopt_makes_the_state_and_blocks_or_refuses_leaving_nothing() -> None:
    table = _table(4, 4)
    slots = table.adopt(_work("s", 6, [7]))
    assert len(slots) == 6 and table.num_computed("s") == 6
    admitted = table.admit(_work("s", 6, [7]))  # the pass it came for runs as on any held sequence
    assert admitted.end == 7 and not admitted.is_new
    with pytest.raises(SequenceRefused) as conflict:
        table.adopt(_work("s", 6, [7]))
    assert conflict.value.code == "kv_handoff_conflict"
    with pytest.raises(SequenceRefused) as full:
        table.adopt(_work("t", 40, [7]))  # 10 blocks; 2 are free
    assert full.value.code == "kv_cache_exhausted" and "t" not in table and table.free_blocks == 2
    no_sampling = _work("u", 2, [7]).model_copy(update={"sampling": None})
    with pytest.raises(SequenceRefused) as missing:
        table.adopt(no_sampling)
    assert missing.value.code == "missing_sampling" and "u" not in table


def test_a_handoff_crosses_a_real_torch_seam_row_for_row() -> None:
    async def main() -> None:
        sender, receiver = KVHandoffs("attn-p", timeout_s=20), KVHandoffs("attn-d", timeout_s=20)
        receiver.seam = TorchSeam("attn-d", receiver.on_frame, receiver.peer_lost, host="127.0.0.1", listen=True)
        sender.seam = TorchSeam("attn-p", sender.on_frame, sender.peer_lost, host="127.0.0.1", listen=True)
        await receiver.seam.start()
        await sender.seam.start()
        try:
            source_kv, source = _store(64, 16), _table(64, 16)
            source.admit(_work("req-1", 0, list(range(1, 38))))  # 37 tokens in 3 blocks
            source._states["req-1"].num_computed = 37  # (the pass's commit, which the worker makes)
            req = KVHandoff(handoff_id="h1", seq_id="req-1", num_tokens=37, to_worker="attn-d",
                            to_address=receiver.seam.address)
            reply = await sender.send(req, source, source_kv, busy=lambda seq_id: False)
            assert reply.ok and reply.nbytes == 6 * 48 * 2 * 8 * 4 and reply.seconds > 0, reply
            arrived = receiver.take("h1")
            assert arrived is not None and receiver.take("h1") is None  # taken once
            target_kv, target = _store(64, 16), _table(64, 16)
            target.admit(_work("other", 0, [1, 2, 3]))  # so the blocks differ from the source's
            slots = target.adopt(_work("req-1", 37, [3]))
            unpack(target_kv, slots, arrived)
            assert torch.equal(_rows(target_kv, slots),
                               _rows(source_kv, source.block_tables.slots("req-1", 0, 37)))
            refused = await sender.send(req.model_copy(update={"seq_id": "nobody"}), source, source_kv,
                                        busy=lambda seq_id: False)
            assert not refused.ok and refused.error is not None and refused.error.code == "kv_handoff_failed"
            busy = await sender.send(req, source, source_kv, busy=lambda seq_id: True)
            assert not busy.ok and "busy" in (busy.error.message if busy.error else "")
            gone = await sender.send(req.model_copy(update={"to_address": "gloo://127.0.0.1:9", "to_worker": "x"}),
                                     source, source_kv, busy=lambda seq_id: False)
            assert not gone.ok and gone.error is not None and gone.error.code == "kv_handoff_unreachable"
        finally:
            await sender.seam.close()
            await receiver.seam.close()

    asyncio.run(main())

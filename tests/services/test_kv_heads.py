"""A P/D handoff's KV between worker groups of different sizes (issue 53): gathered whole, put by heads.

The ranks are threads with their own gloo group each, as in tests/shared/model/test_sharding.py; the caches are
a whole model's, split by KV heads as sharding.py splits them. A sequence's KV gathered from a TP2 group is what
one device's cache packs (the format every worker sends), and a whole KV put into a group lands each head on
every rank that reads it (Qwen3's one KV head on both ranks of a TP2 group).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.attention_worker.kv_handoff import pack
from services.attention_worker.kv_heads import gather, owned_heads, put
from shared.model.attention import PagedKVStore
from shared.model.checkpoint import open_checkpoint
from shared.model.sharding import Sharding, attention_args, kv_heads
from shared.transport.device_group import DeviceGroup
from tests.shared.model.test_sharding import run_ranks

BLOCK = 4
SLOTS = 64


def _stores(args, tp: int) -> tuple[PagedKVStore, list[PagedKVStore]]:  # type: ignore[no-untyped-def]
    """A whole model's cache of random K and V, and each rank's share of it (its KV heads, the same slots)."""
    torch.manual_seed(0)
    whole = PagedKVStore(args, SLOTS, torch.float32, torch.device("cpu"))
    for cache in (*whole.k, *whole.v):
        cache.copy_(torch.randn_like(cache))
    shares = []
    for rank in range(tp):
        share = PagedKVStore(attention_args(args, Sharding(rank, tp)), SLOTS, torch.float32, torch.device("cpu"))
        first, count = kv_heads(args, Sharding(rank, tp))
        for mine, theirs in zip((*share.k, *share.v), (*whole.k, *whole.v), strict=True):
            mine.copy_(theirs[:, first:first + count])
        shares.append(share)
    return whole, shares


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # 2 KV heads split; 1 KV head replicated
def test_a_groups_kv_is_gathered_whole_and_put_by_heads(tiny_checkpoints: dict[str, Path], arch: str) -> None:
    args = open_checkpoint(str(tiny_checkpoints[arch])).args
    whole, shares = _stores(args, 2)
    blocks, tokens = [5, 2, 9], 10  # a sequence's block table, its first 10 tokens
    expected = pack(whole, blocks, BLOCK, tokens)  # [2L, 12, Hkv, hd]: what a worker of one device sends

    def handoff(group: DeviceGroup) -> list[torch.Tensor]:
        gathered = gather(shares[group.rank], args, group, blocks, BLOCK, tokens)
        slots = list(range(40, 40 + tokens))  # the decode side's fresh slots
        put(shares[group.rank], args, group, slots, expected)
        return [gathered, *(cache[40:40 + tokens] for cache in (*shares[group.rank].k, *shares[group.rank].v))]

    results = run_ranks(2, handoff)
    for rank, (gathered, *written) in enumerate(results):
        assert torch.equal(gathered, expected)  # every head once, from the rank that holds it first
        first, count = kv_heads(args, Sharding(rank, 2))
        for layer_cache, want in zip(written, expected, strict=True):
            assert torch.equal(layer_cache, want[:tokens, first:first + count])


def test_each_kv_head_is_gathered_from_one_rank() -> None:
    """Owned spans tile the heads: split (8 KV heads over 4 ranks) and replicated (4 KV heads over 8 ranks)."""
    from loadgen.sim.models import get_model

    for name, tp in (("qwen3-32b", 4), ("qwen3-32b", 8), ("qwen3-30b-a3b", 8)):
        args = get_model(name)
        spans = [owned_heads(args, rank, tp) for rank in range(tp)]
        heads = [h for start, end in spans for h in range(start, end)]
        assert heads == list(range(args.n_kv_heads)), (name, tp, spans)

"""A P/D handoff's KV across worker groups: gathered whole from the ranks that hold its heads, put on the ranks
that read them.

A group's KV cache is split by KV heads (shared/model/sharding.py's `kv_heads`: a share of them per rank, or one
replicated where the group outnumbers them), so what travels between attention workers is the whole KV in the
model's head order, [2 * n_layers, rows, n_kv_heads, head_dim], whatever either side's group size: a worker of
one device packs and takes it as it is (kv_handoff.py). Rank 0 of a prefill group gathers it: each rank packs
its heads into a zeroed whole and one all-reduce sums them (each head from the first rank holding it). Rank 0 of
a decode group sends it to its ranks with the sequence's slots (one broadcast), and each writes its own heads.
So a KV head reaches the rank that holds it by way of the two ranks 0: leader to leader, as the layers' seam.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from services.attention_worker.kv_handoff import pack, unpack
from shared.model.attention import PagedKVStore
from shared.model.config import ModelArgs
from shared.model.sharding import Sharding, kv_heads
from shared.transport.device_group import DeviceGroup

KV_GATHER = "kv_gather"  # the followers' share of a sequence's KV into rank 0's whole
KV_PUT = "kv_put"  # an arrived whole KV into every rank's cache


def owned_heads(args: ModelArgs, rank: int, tp: int) -> tuple[int, int]:
    """[start, end) of the KV heads rank `rank` is the first to hold (a replicated head counts once)."""
    first, count = kv_heads(args, Sharding(rank, tp))
    if rank == 0:
        return first, first + count
    before_first, before_count = kv_heads(args, Sharding(rank - 1, tp))
    return max(first, before_first + before_count), first + count


def gather(kv: PagedKVStore, args: ModelArgs, group: DeviceGroup, blocks: list[int], block_size: int,
           num_tokens: int) -> Tensor:
    """Every rank's part of a sequence's whole KV (each calls it, in the same command): -> [2L, rows, Hkv, hd]."""
    with torch.inference_mode():
        local = pack(kv, blocks, block_size, num_tokens)  # [2L, rows, this rank's heads, hd]
        first, _ = kv_heads(args, Sharding(group.rank, group.size))
        start, end = owned_heads(args, group.rank, group.size)
        whole = local.new_zeros((local.shape[0], local.shape[1], args.n_kv_heads, local.shape[3]))
        whole[:, :, start:end] = local[:, :, start - first:end - first]
        return group.all_reduce(whole)


def put(kv: PagedKVStore, args: ModelArgs, group: DeviceGroup, slots: list[int], whole: Tensor) -> None:
    """This rank's heads of an arrived whole KV [2L, rows, Hkv, hd] into `slots` of its cache."""
    first, count = kv_heads(args, Sharding(group.rank, group.size))
    with torch.inference_mode():
        unpack(kv, slots, whole[:, :, first:first + count])


@dataclass
class GroupKV:
    """Rank 0's side: each call a command its followers run too (`follower.py` answers KV_GATHER and KV_PUT)."""

    group: DeviceGroup
    args: ModelArgs  # the whole model's (its KV heads all), not this rank's share

    def gather(self, kv: PagedKVStore, blocks: list[int], block_size: int, num_tokens: int) -> Tensor:
        with self.group.step(KV_GATHER, blocks=blocks, block_size=block_size, num_tokens=num_tokens):
            return gather(kv, self.args, self.group, blocks, block_size, num_tokens)

    def put(self, kv: PagedKVStore, slots: list[int], whole: Tensor) -> None:
        with self.group.step(KV_PUT, [whole], slots=slots):
            put(kv, self.args, self.group, slots, whole)

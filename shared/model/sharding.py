"""Which part of a half one rank of a worker group holds, Megatron's way.

A group of `tp * ep` ranks splits a half so that each layer ends in exactly one all-reduce:

- attention: q/k/v by heads (columns), o_proj by the same heads (rows); the KV cache by KV heads (a KV
  head is replicated where the group is larger than the model's KV heads: each rank keeps the one its
  query heads read). Embeddings, norms and the LM head are replicated.
- FFN: gate/up by columns and down by rows; an MoE's experts whole to their expert-parallel rank
  (`ep`), each held expert split by columns/rows over the tensor-parallel ranks (`tp`) inside it; the
  router is replicated, so every rank picks the same experts for every token. Dense layers of an MoE
  split over all `tp * ep` ranks.

Each rank's partial output is summed by the group's all-reduce: the same sum as one device, in
another order (float rounding differs; docs/architecture.md says by how much).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shared.errors import AFlexError
from shared.model.config import ModelArgs


class ShardingError(AFlexError):
    """A group size that does not divide the model: heads, FFN width or experts."""


@dataclass(frozen=True)
class Sharding:
    """Rank `rank` of a group of `tp * ep` ranks (rank = ep_rank * tp + tp_rank)."""

    rank: int = 0
    tp: int = 1
    ep: int = 1

    @property
    def size(self) -> int:
        return self.tp * self.ep

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def ep_rank(self) -> int:
        return self.rank // self.tp

    def __post_init__(self) -> None:
        if self.tp < 1 or self.ep < 1:
            raise ShardingError(f"group sizes must be >= 1, got tp={self.tp} ep={self.ep}")
        if not 0 <= self.rank < self.size:
            raise ShardingError(f"rank {self.rank} is not in a group of {self.size}")


WHOLE = Sharding()


def _span(total: int, parts: int, index: int, what: str) -> tuple[int, int]:
    """(start, length) of part `index` of `total` split in `parts` equal parts."""
    if total % parts:
        raise ShardingError(f"{what} ({total}) does not split over {parts} ranks")
    length = total // parts
    return index * length, length


# -- attention ------------------------------------------------------------------------------------


def query_heads(args: ModelArgs, sharding: Sharding) -> tuple[int, int]:
    """(first, count) of the query heads this rank holds."""
    if sharding.ep != 1:
        raise ShardingError("attention splits by tensor parallelism only (ep must be 1)")
    return _span(args.n_heads, sharding.tp, sharding.tp_rank, "query heads")


def kv_heads(args: ModelArgs, sharding: Sharding) -> tuple[int, int]:
    """(first, count) of the KV heads this rank's query heads read: a share of them, or one, replicated."""
    first_q, n_q = query_heads(args, sharding)
    group = args.n_heads // args.n_kv_heads  # query heads per KV head
    if sharding.tp <= args.n_kv_heads and args.n_kv_heads % sharding.tp:  # each rank's query heads read
        raise ShardingError(f"KV heads ({args.n_kv_heads}) do not split over {sharding.tp} ranks")  # its own
    if sharding.tp > args.n_kv_heads and sharding.tp % args.n_kv_heads:
        raise ShardingError(f"{args.n_kv_heads} KV heads cannot be shared by {sharding.tp} ranks")
    first_kv, last_kv = first_q // group, (first_q + n_q - 1) // group
    return first_kv, last_kv - first_kv + 1


def attention_args(args: ModelArgs, sharding: Sharding) -> ModelArgs:
    """The shape of one rank's attention half: its heads (the rest of the model is replicated)."""
    if sharding.size == 1:
        return args
    _, n_q = query_heads(args, sharding)
    _, n_kv = kv_heads(args, sharding)
    return replace(args, n_heads=n_q, n_kv_heads=n_kv)


def attention_slice(key: str, args: ModelArgs, sharding: Sharding) -> tuple[int, int, int] | None:
    """(dim, start, length) of checkpoint tensor `key` (an AttentionHalf key) this rank holds; None: whole."""
    if sharding.size == 1 or ".self_attn." not in key or "_norm." in key:
        return None
    hd = args.head_dim
    if ".q_proj." in key:
        first, count = query_heads(args, sharding)
        return 0, first * hd, count * hd
    if ".k_proj." in key or ".v_proj." in key:
        first, count = kv_heads(args, sharding)
        return 0, first * hd, count * hd
    if ".o_proj." in key:
        first, count = query_heads(args, sharding)
        return 1, first * hd, count * hd
    return None


# -- FFN ------------------------------------------------------------------------------------------


def held_experts(args: ModelArgs, sharding: Sharding) -> range:
    """The experts (global ids) this rank's expert-parallel share holds."""
    start, length = _span(args.n_experts, sharding.ep, sharding.ep_rank, "experts") if args.n_experts else (0, 0)
    return range(start, start + length)


def ffn_args(args: ModelArgs, sharding: Sharding) -> ModelArgs:
    """The shape of one rank's FFN half: dense widths over the whole group, expert widths over `tp`."""
    if sharding.size == 1:
        return args
    if sharding.ep > 1 and not args.n_experts:
        raise ShardingError("expert parallelism (ep > 1) needs a mixture-of-experts model")
    dense = _span(args.intermediate_size, sharding.size, 0, "the FFN width")[1]
    expert = _span(args.moe_intermediate_size, sharding.tp, 0, "an expert's width")[1] if args.n_experts else 0
    held_experts(args, sharding)  # raises when the experts do not split
    return replace(args, intermediate_size=dense, moe_intermediate_size=expert)


def ffn_slice(key: str, args: ModelArgs, sharding: Sharding) -> tuple[int, int, int] | None:
    """(dim, start, length) of checkpoint tensor `key` (an FFNHalf key) this rank holds; None: whole."""
    if sharding.size == 1:
        return None
    parts = key.split(".")  # layers.N.<rest>
    if ".experts." in key:  # layers.N.experts.E.<proj>.weight: an expert's width over tp
        width, parts_n, index = args.moe_intermediate_size, sharding.tp, sharding.tp_rank
    elif args.is_moe_layer(int(parts[1])):  # the router: replicated
        return None
    else:  # a dense layer: its width over the whole group
        width, parts_n, index = args.intermediate_size, sharding.size, sharding.rank
    start, length = _span(width, parts_n, index, "the FFN width")
    return (1 if ".down_proj." in key else 0), start, length

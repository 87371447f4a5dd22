"""Which worker groups the live mesh can form for a model, and what each rank holds: the planners' one rule.

A group splits its half as shared/model/sharding.py does, so a size is formable only where the model's heads,
FFN widths and experts divide over it; and a rank holds more than its 1/N of the half: the embeddings, the
LM head and the norms are whole on every rank, and a KV head is replicated where the group outnumbers them.
`rank_weight_bytes` and `kv_room_tokens` count that, in bf16 (shared/model/sizes.py), so a plan that fits
here fits on the GPUs.
"""

from __future__ import annotations

from typing import Literal

from shared.model.config import ModelArgs
from shared.model.sharding import Sharding, ShardingError, attention_args, ffn_args, held_experts, kv_heads
from shared.model.sizes import DTYPE_BYTES, attention_weight_bytes

Half = Literal["attention", "ffn", "whole"]
MEMORY_FRACTION = 0.9  # of a GPU's memory, for weights and KV (the rest: activations, the CUDA context)


def formable(args: ModelArgs, half: Half, tp: int, ep: int = 1) -> bool:
    """Whether a group of `tp` x `ep` ranks can hold `half` (a whole-model group: tp over both halves)."""
    try:
        if half in ("attention", "whole"):
            attention_args(args, Sharding(0, tp))
        if half in ("ffn", "whole"):
            ffn_args(args, Sharding(0, tp, ep if half == "ffn" else 1))
    except ShardingError:
        return False
    return True


def ffn_group_formable(args: ModelArgs, gpus: int) -> bool:
    """Whether `gpus` ranks can hold the FFN half as one group: by width (tp), by experts (ep), or both."""
    return any(gpus % tp == 0 and formable(args, "ffn", tp, gpus // tp) for tp in range(1, gpus + 1))


def _ffn_rank_bytes(args: ModelArgs, sharding: Sharding) -> float:
    shard = ffn_args(args, sharding)
    experts = len(held_experts(args, sharding))
    per_layer = [experts * 3 * args.dim * shard.moe_intermediate_size + args.dim * args.n_experts
                 if args.is_moe_layer(layer) else 3 * args.dim * shard.intermediate_size
                 for layer in range(args.n_layers)]
    return float(sum(per_layer)) * DTYPE_BYTES


def rank_weight_bytes(args: ModelArgs, half: Half, tp: int, ep: int = 1) -> float:
    """The bf16 weight bytes one rank of the group holds (the most any rank holds)."""
    sharding = Sharding(0, tp, ep if half == "ffn" else 1)
    attention = attention_weight_bytes(attention_args(args, Sharding(0, tp))) if half != "ffn" else 0.0
    ffn = _ffn_rank_bytes(args, sharding) if half != "attention" else 0.0
    return attention + ffn


def rank_kv_bytes_per_token(args: ModelArgs, tp: int) -> float:
    """KV bytes one rank keeps per token: its KV heads' share, every layer."""
    _, n_kv = kv_heads(args, Sharding(0, tp))
    return float(2 * n_kv * args.head_dim * args.n_layers * DTYPE_BYTES)


def kv_room_tokens(args: ModelArgs, half: Half, tp: int, gpu_memory_bytes: float,
                   memory_fraction: float = MEMORY_FRACTION) -> int:
    """Tokens of KV a group of `tp` ranks holding `half` has room for (0: the weights alone do not fit; an FFN
    group holds no KV)."""
    free = memory_fraction * gpu_memory_bytes - rank_weight_bytes(args, half, tp)
    if free <= 0:
        return 0
    return int(free // rank_kv_bytes_per_token(args, tp)) if half != "ffn" else 0


def fits(args: ModelArgs, half: Half, tp: int, gpu_memory_bytes: float, ep: int = 1,
         memory_fraction: float = MEMORY_FRACTION) -> bool:
    """Formable, and each rank's weights fit its GPU (with KV room, where the half holds KV)."""
    if not formable(args, half, tp, ep):
        return False
    free = memory_fraction * gpu_memory_bytes - rank_weight_bytes(args, half, tp, ep)
    return free > 0 and (half == "ffn" or kv_room_tokens(args, half, tp, gpu_memory_bytes, memory_fraction) > 0)

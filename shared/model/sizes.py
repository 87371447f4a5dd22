"""What a model's halves and its KV cache weigh in GPU memory (bf16), for the planners' memory checks."""

from __future__ import annotations

from shared.model.config import ModelArgs

DTYPE_BYTES = 2  # bf16 weights, activations and KV cache


def attention_weight_bytes(args: ModelArgs) -> float:
    per_layer = args.dim * (args.q_dim + 2 * args.kv_dim) + args.q_dim * args.dim
    embeddings = (1 if args.tie_word_embeddings else 2) * args.vocab_size * args.dim  # input table + LM head
    return float(per_layer * args.n_layers + embeddings) * DTYPE_BYTES


def ffn_weight_bytes(args: ModelArgs) -> float:
    if args.n_experts:
        per_layer = args.n_experts * 3 * args.dim * args.moe_intermediate_size + args.dim * args.n_experts
    else:
        per_layer = 3 * args.dim * args.intermediate_size
    return float(per_layer * args.n_layers) * DTYPE_BYTES


def kv_bytes_per_token(args: ModelArgs) -> float:
    return float(2 * args.kv_dim * args.n_layers * DTYPE_BYTES)

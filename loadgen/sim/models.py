"""Model profiles the simulator serves, as `ModelArgs` (shapes from the models' HF config.json)."""

from __future__ import annotations

from shared.model.config import ModelArgs
from shared.model.sizes import DTYPE_BYTES, attention_weight_bytes, ffn_weight_bytes, kv_bytes_per_token

__all__ = ["DTYPE_BYTES", "MODELS", "attention_weight_bytes", "ffn_weight_bytes", "get_model", "kv_bytes_per_token"]

MODELS: dict[str, ModelArgs] = {
    # Qwen/Qwen3-32B config.json: hidden 5120, 64 layers, 64 q heads, 8 kv heads, head_dim 128, MLP 25600
    "qwen3-32b": ModelArgs(arch="qwen3", vocab_size=151936, dim=5120, n_layers=64, n_heads=64, n_kv_heads=8,
                           head_dim=128, intermediate_size=25600, qk_norm=True, max_seq_len=40960),
    # mistralai/Mixtral-8x7B-v0.1 config.json: hidden 4096, 32 layers, 32/8 heads, 8 experts top-2, 14336
    "mixtral-8x7b": ModelArgs(arch="mixtral", vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                              head_dim=128, intermediate_size=14336, n_experts=8, n_experts_per_tok=2,
                              moe_intermediate_size=14336, sparse_layers=tuple(range(32)), max_seq_len=32768),
    # Qwen/Qwen3-30B-A3B config.json: hidden 2048, 48 layers, 32/4 heads of 128, 128 experts top-8 of 768
    # (an MoE with many small experts: a decode batch touches most of them, so its FFN reads nearly all weights)
    "qwen3-30b-a3b": ModelArgs(arch="qwen3_moe", vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                               head_dim=128, intermediate_size=6144, qk_norm=True, n_experts=128, n_experts_per_tok=8,
                               moe_intermediate_size=768, sparse_layers=tuple(range(48)), max_seq_len=40960),
    # Qwen/Qwen3-235B-A22B config.json: hidden 4096, 94 layers, 64/4 heads of 128, 128 experts top-8 of 1536
    "qwen3-235b-a22b": ModelArgs(arch="qwen3_moe", vocab_size=151936, dim=4096, n_layers=94, n_heads=64,
                                 n_kv_heads=4, head_dim=128, intermediate_size=12288, qk_norm=True, n_experts=128,
                                 n_experts_per_tok=8, moe_intermediate_size=1536, sparse_layers=tuple(range(94)),
                                 max_seq_len=40960),
    # meta-llama/Meta-Llama-3-8B config.json: hidden 4096, 32 layers, 32/8 heads, MLP 14336
    "llama-3-8b": ModelArgs(arch="llama", vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                            head_dim=128, intermediate_size=14336, max_seq_len=8192),
    # meta-llama/Llama-3.1-8B config.json: the shapes of Llama-3-8B, 128k context
    "llama-3.1-8b": ModelArgs(arch="llama", vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                              head_dim=128, intermediate_size=14336, max_seq_len=131072),
    # meta-llama/Llama-3.3-70B-Instruct config.json: hidden 8192, 80 layers, 64/8 heads, head_dim 128, MLP 28672
    "llama-3.3-70b": ModelArgs(arch="llama", vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                               head_dim=128, intermediate_size=28672, max_seq_len=131072),
    # ministral/Ministral-3b-instruct config.json: hidden 4096, 14 layers, 32/8 heads, head_dim 128, MLP 14336
    "ministral-3b": ModelArgs(arch="llama", vocab_size=32000, dim=4096, n_layers=14, n_heads=32, n_kv_heads=8,
                              head_dim=128, intermediate_size=14336, max_seq_len=32768),
    # HuggingFaceTB/SmolLM2-135M(-Instruct) config.json (the mesh's `--model default`): hidden 576, 30 layers,
    # 9 q heads, 3 kv heads, head_dim 64, MLP 1536, tied embeddings
    "smollm2-135m": ModelArgs(arch="llama", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                              head_dim=64, intermediate_size=1536, tie_word_embeddings=True, max_seq_len=8192),
}

def get_model(name: str) -> ModelArgs:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None

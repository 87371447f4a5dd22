"""Model arguments: one dataclass for every supported architecture.

The same `ModelArgs` drives both halves of the split model, so an attention worker and an FFN
worker built from one checkpoint agree on every dimension. It is read from an HF `config.json`
(transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`) or from GGUF metadata,
which the GGUF reader first turns into the same HF-style dict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.errors import CheckpointError, UnknownArchitectureError

SUPPORTED_ARCHITECTURES = ("llama", "qwen3", "qwen3_moe", "mixtral")


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling (Llama 3.1+); `rope_type == "default"` means none."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_seq_len: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim on q and k before RoPE
    # Mixture of experts (qwen3_moe, mixtral); n_experts == 0 means a dense SwiGLU MLP.
    n_experts: int = 0
    n_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1
    sparse_layers: tuple[int, ...] = ()  # layers whose FFN is the MoE; the others are dense
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_experts > 0 and layer in self.sparse_layers

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], source: str = "config.json") -> ModelArgs:
        """Build from an HF config dict; raise a typed error naming `source` on anything unknown."""
        arch = str(config.get("model_type", "")).lower()
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnknownArchitectureError(arch or "<missing model_type>", source, SUPPORTED_ARCHITECTURES)
        try:
            dim = int(config["hidden_size"])
            n_heads = int(config["num_attention_heads"])
            n_layers = int(config["num_hidden_layers"])
            vocab_size = int(config["vocab_size"])
        except KeyError as exc:
            raise CheckpointError(f"{source} lacks required key {exc.args[0]!r}") from None
        n_kv_heads = int(config.get("num_key_value_heads") or n_heads)
        head_dim = int(config.get("head_dim") or dim // n_heads)
        if n_heads % n_kv_heads:
            raise CheckpointError(f"{source}: num_attention_heads {n_heads} is not a multiple of "
                                  f"num_key_value_heads {n_kv_heads}")
        rope = dict(config.get("rope_parameters") or {})
        rope_theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        scaling = dict(config.get("rope_scaling") or {})
        scaling.update({k: v for k, v in rope.items() if k != "rope_theta"})
        rope_type = str(scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type not in ("default", "llama3"):
            raise CheckpointError(f"{source}: rope scaling type {rope_type!r} is not supported "
                                  "(supported: default, llama3)")
        rope_scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(scaling.get("factor", 1.0)),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
        )
        n_experts, per_tok, moe_size, norm_topk = 0, 0, 0, True
        sparse_layers: tuple[int, ...] = ()
        if arch == "mixtral":
            n_experts = int(config.get("num_local_experts", 8))
            per_tok = int(config.get("num_experts_per_tok", 2))
            moe_size = int(config["intermediate_size"])
            sparse_layers = tuple(range(n_layers))
        elif arch == "qwen3_moe":
            n_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
            per_tok = int(config.get("num_experts_per_tok", 0))
            moe_size = int(config.get("moe_intermediate_size", 0))
            norm_topk = bool(config.get("norm_topk_prob", False))
            step = int(config.get("decoder_sparse_step", 1) or 1)
            dense_only = set(config.get("mlp_only_layers") or [])
            sparse_layers = tuple(
                i for i in range(n_layers) if i not in dense_only and n_experts > 0 and (i + 1) % step == 0
            )
        eos = config.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        bos = config.get("bos_token_id")
        return cls(
            arch=arch,
            vocab_size=vocab_size,
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            intermediate_size=int(config.get("intermediate_size", 0)),
            norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_seq_len=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            n_experts=n_experts,
            n_experts_per_tok=per_tok,
            moe_intermediate_size=moe_size,
            norm_topk_prob=norm_topk,
            sparse_layers=sparse_layers,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_json_file(cls, path: Path) -> ModelArgs:
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read model config {path}: {exc}") from None
        return cls.from_hf_config(config, source=str(path))

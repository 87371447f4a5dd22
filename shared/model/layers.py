"""Building blocks shared by both halves: RMSNorm, rotary embeddings, SwiGLU.

They reproduce the HF reference numerics exactly (norms in float32, RoPE tables computed in
float32 with the rotate-half layout of HF checkpoints) so that split and unsplit paths and
`transformers` give identical greedy tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shared.model.config import ModelArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., dim]; statistics in float32 whatever the activation dtype, as HF does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(args: ModelArgs) -> Tensor:
    """Inverse frequencies [head_dim/2], with llama3-style scaling when the config asks for it."""
    dim = args.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (args.rope_theta ** exponents)
    scaling = args.rope_scaling
    if scaling.rope_type != "llama3":
        return inv_freq
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables indexed by absolute position; grown on demand past `max_seq_len`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        # A plain attribute, not a buffer: halves are built on the meta device and then
        # `to_empty`-ed, which would leave a buffer uninitialised.
        self.inv_freq = rope_inv_freq(args)
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)
        self._build(min(args.max_seq_len, 8192))

    def _build(self, n_positions: int) -> None:
        positions = torch.arange(n_positions, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * self.inv_freq.float()[None, :]  # [P, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, hd]
        self._cos, self._sin = emb.cos(), emb.sin()

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # positions: [T] -> cos, sin: [T, 1, hd] (broadcast over heads)
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if needed > self._cos.shape[0]:
            self._build(max(needed, 2 * self._cos.shape[0]))
        cos = self._cos.to(positions.device)[positions]
        sin = self._sin.to(positions.device)[positions]
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [T, H, hd]; rotate-half layout of HF checkpoints
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense MLP of every supported architecture and one expert."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate and up fused in one Int8Linear (quantize_int8)

    def quantize_int8(self) -> None:
        """Fuse gate/up into one W8A8 product (one input quantisation), and down_proj W8A8."""
        from shared.model.quant import Int8Linear, fuse_int8

        self.gate_up_proj = fuse_int8([self.gate_proj, self.up_proj])
        self.down_proj = Int8Linear.from_linear(self.down_proj)  # type: ignore[assignment]
        del self.gate_proj, self.up_proj

    def fuse_gate_up(self) -> None:
        """gate and up as one product of the concatenated weights: bit-equal to the two apart (each output
        is the same dot product; checked at 1-256 rows), one weight stream and one call fewer a layer
        (1.5 ms of a 60 ms 16-row decode step of SmolLM2: docs/benchmarks.md, issue 42)."""
        gate, up = self.gate_proj, self.up_proj
        fused = nn.Linear(gate.in_features, 2 * gate.out_features, bias=False, device=gate.weight.device,
                          dtype=gate.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([gate.weight, up.weight]))  # [2F, D]
        self.gate_up_proj = fused
        del self.gate_proj, self.up_proj

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, D] -> [T, D]
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, 2F] -> 2 x [T, F]
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

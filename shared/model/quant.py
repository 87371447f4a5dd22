"""W8A8 int8 matrix products for the CPU: int8 weights per output channel, int8 activations per token.

Why: on a CPU a decode step at a few dozen rows is bound by its float32 matrix products (80% of
a SmolLM2 step). int8 x int8 -> int32 products on AVX-512 VNNI run several times faster than
float32 GEMMs and read a quarter of the weight bytes: the fused kernel of cpu_kernels.py where it
builds, `torch._int_mm` (oneDNN) with torch ops around it elsewhere, with bit-identical results.

Why per-token activation scales (and not fbgemm's per-tensor dynamic quantisation): each row is
quantised with its own scale and accumulated exactly in int32, so a row's result does not depend
on which other rows share its matrix product. A sequence's tokens are then the same whatever
else is in its batch or microbatch, and the split engine equals the unsplit forward token for
token, as in float32. What changes is the numerics against the float32 reference: `--quantize
int8` is an opt-in speed mode, its agreement with float32 is measured by
benchmarks/engine_decode.py and written to docs/benchmarks.md.

What stays in floating point: embeddings, norms, RoPE, attention scores (softmax over the KV
cache), the MoE router (routing decisions are sensitive), residual adds and sampling.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from shared.errors import AFlexError
from shared.model.cpu_kernels import CPUKernels, kernel_choice, load_kernels

Quantization = Literal["none", "int8"]
QUANTIZATIONS: tuple[str, ...] = ("none", "int8")

_INT8_MAX = 127.0
_INT16_MAX = 32767.0
ROTATION_BLOCK = 64  # spreads an outlier channel over 64 (SmolLM2: 95% top-1 agreement vs 82% unrotated)


class QuantizationError(AFlexError):
    """A quantisation mode that does not exist or cannot run on the chosen device."""


def check_quantization(quantize: str, device: torch.device | str) -> Quantization:
    if quantize not in QUANTIZATIONS:
        raise QuantizationError(f"unknown quantization {quantize!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if quantize == "int8":
        kernel_choice()  # a bad AFLEX_CPU_KERNELS fails here, before any weight is read
    if quantize == "int8" and torch.device(device).type != "cpu":
        raise QuantizationError(f"--quantize int8 runs on the CPU (VNNI int8 matrix products), not on {device}; "
                                "on a GPU use --dtype bfloat16")
    return quantize  # type: ignore[return-value]


def hadamard_signs(n: int) -> Tensor:
    """The Sylvester-Hadamard matrix of +-1 entries [n, n] (n a power of two): S @ S.T = n I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard block needs a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard(n: int) -> Tensor:
    """The orthonormal Hadamard matrix [n, n]: H @ H.T = I, H = H.T."""
    return hadamard_signs(n) / math.sqrt(n)


def rotation_block(in_features: int) -> int:
    """The Hadamard block for an input width: the largest power of two <= ROTATION_BLOCK dividing it."""
    block = ROTATION_BLOCK
    while in_features % block:
        block //= 2
    return block


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row: x [M, K] -> (q [M, K] int8, scale [M, 1] float32), x ~= q * scale."""
    x32 = x.float()
    scale = _row_absmax(x32).div_(_INT8_MAX)  # [M, 1]
    return x32.div(scale).round_().to(torch.int8), scale


def _row_absmax(x: Tensor) -> Tensor:
    # x: [M, K] -> max |x| per row [M, 1], at least 1e-12 (abs + amax: 6x faster here than the inf-norm)
    return x.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12)


class Int8Linear(nn.Module):
    """y = x @ W.T (+ b) with W int8 per output channel and x int8 per row, accumulated in int32.

    Both sides are first rotated by a block-diagonal Hadamard matrix R (x @ W.T = (x R) @ (W R).T,
    R orthonormal): a few outlier channels of x (SmolLM2's MLP inputs reach 100x the median
    channel) would otherwise set each row's scale and flatten everything else to a few levels.
    Rotating spreads them over a block, as QuaRot does, from the weights alone: no calibration
    data, and the attention and FFN halves quantise independently.

    Two backends, bit-identical: the fused VNNI kernel (cpu_kernels.py) where it is available,
    else torch ops around `torch._int_mm`. Buffers: `packed` (the kernel's weight panels) or
    `weight_t` [K, N] int8 (the transposed layout `torch._int_mm` reads), `weight_scale` [N]
    float32, `signs` [B, B] (the unnormalised Hadamard block), `bias` [N] or None.
    """

    weight_t: Tensor | None
    packed: Tensor | None
    weight_scale: Tensor
    signs: Tensor
    bias: Tensor | None

    def __init__(self, weight: Tensor, bias: Tensor | None = None, rotate: bool = True,
                 use_kernel: bool = True) -> None:
        super().__init__()
        # weight: [N, K] float -> rotated, then int8 [N, K] with one scale per output row
        self.out_features, self.in_features = weight.shape
        self.block = rotation_block(self.in_features) if rotate else 1
        rotation = hadamard(self.block)
        rotated = weight.detach().float()
        if self.block > 1:
            rotated = (rotated.reshape(-1, self.block) @ rotation).reshape(rotated.shape)
        q, scale = quantize_rows(rotated)
        # The activation side uses the +-1 matrix on integer-valued rows (see _rotate_rows) and folds
        # the 1/sqrt(B) into its scale.
        self.register_buffer("signs", hadamard_signs(self.block), persistent=False)  # [B, B] of +-1
        self.kernel: CPUKernels | None = load_kernels() if use_kernel else None
        packed = self.kernel.pack(q) if self.kernel is not None else None
        self.register_buffer("packed", packed, persistent=False)  # [N/64, K/4, 256] uint8
        self.register_buffer("weight_t", None if packed is not None else q.t(), persistent=False)  # [K, N] view
        self.register_buffer("weight_scale", scale.squeeze(1) / math.sqrt(self.block), persistent=False)  # [N]
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)

    def _rotate_rows(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """rows [M, K] float -> (integer-valued rows @ blockdiag(signs) [M, K], scale [M, 1]).

        Why integers: a float matrix product's rounding depends on how many rows it multiplies
        (the kernel's blocking), which would make a row's int8 codes depend on its batch. Rounded
        first to 16-bit integers, every partial sum of +-1 products is an integer below 2^21, exact
        in float32 whatever the summation order, so the rotation is exact and batch-independent.
        """
        scale = _row_absmax(rows).div_(_INT16_MAX)  # [M, 1]
        integers = rows.div(scale).round_()  # [M, K], |value| <= 32767
        rotated = (integers.reshape(-1, self.block) @ self.signs).reshape(rows.shape)
        return rotated, scale

    @classmethod
    def from_linear(cls, linear: nn.Linear, rotate: bool = True) -> Int8Linear:
        return cls(linear.weight, linear.bias, rotate)

    @property
    def backend(self) -> str:
        return "vnni" if self.kernel is not None else "torch"

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., K] -> [..., N], in x's dtype
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).float()  # [M, K]
        if self.kernel is not None and self.packed is not None:
            y = self.kernel.int8_linear(rows, self.packed, self.weight_scale, self.bias, self.block, self.out_features)
            return y.to(x.dtype).reshape(*lead, self.out_features)
        assert self.weight_t is not None
        pre_scale: Tensor | float = 1.0
        if self.block > 1:
            rows, pre_scale = self._rotate_rows(rows)
        q, scale = quantize_rows(rows)
        acc = torch._int_mm(q, self.weight_t)  # [M, N] int32, exact
        y = torch.mul(acc, scale * pre_scale).mul_(self.weight_scale)  # int32 * float32 -> float32
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, w8a8, hadamard={self.block}, "
                f"backend={self.backend}")


def fuse_int8(linears: list[nn.Linear]) -> Int8Linear:
    """One Int8Linear for projections that read the same input (q/k/v, gate/up): one quantisation
    of the input and one matrix product; the caller splits the output [..., sum of N]."""
    biases = [lin.bias for lin in linears]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else torch.zeros(lin.out_features) for b, lin in zip(biases, linears, strict=True)])
    return Int8Linear(torch.cat([lin.weight for lin in linears]), bias)

"""The work of one layer's attention half, FFN half and the LM head, for the emulated roofline.

Each function returns a `ComposedWork`: an `OperatorWork` whose flops and bytes are the totals (what
any backend sees) and whose `parts` are the kernels that run one after another (projections, the
attention core, the expert GEMMs). The emulated GPU takes a roofline per part, since kernels do not
overlap: one big max() over the sum would hide a compute-bound GEMM behind a memory-bound KV read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.gpu.base import OperatorWork
from shared.model.config import ModelArgs


@dataclass(frozen=True)
class ComposedWork(OperatorWork):
    parts: tuple[OperatorWork, ...] = ()


def _compose(kind: str, parts: Sequence[OperatorWork]) -> ComposedWork:
    return ComposedWork(
        flops=sum(p.flops for p in parts), bytes_moved=sum(p.bytes_moved for p in parts), kind=kind, parts=tuple(parts)
    )


def _gemm(kind: str, n_tokens: int, d_in: int, d_out: int, dtype_bytes: int, n_matrices: int = 1) -> OperatorWork:
    """`n_matrices` weight matrices of d_in×d_out applied to `n_tokens` rows."""
    flops = 2.0 * n_tokens * d_in * d_out * n_matrices
    weights = float(d_in) * d_out * n_matrices * dtype_bytes
    activations = float(n_tokens) * (d_in + d_out * n_matrices) * dtype_bytes
    return OperatorWork(flops=flops, bytes_moved=weights + activations, kind=kind)


def attention_work(args: ModelArgs, n_tokens: int, context_tokens: list[int], dtype_bytes: int = 2) -> ComposedWork:
    """One layer's attention half for a microbatch of `n_tokens` new tokens over sequences whose
    contexts (new tokens included) are `context_tokens`. Decode when every sequence adds one token;
    otherwise prefill, with the new tokens split evenly over the sequences."""
    n_seq = max(1, len(context_tokens))
    phase = "decode" if n_tokens == len(context_tokens) else "prefill"
    kind = f"attention.{phase}"
    qkv = _gemm(f"{kind}.qkv", n_tokens, args.dim, args.q_dim + 2 * args.kv_dim, dtype_bytes)
    core_flops = core_bytes = 0.0
    for ctx in context_tokens or [n_tokens]:
        q = min(ctx, max(1, round(n_tokens / n_seq)))
        pairs = q * ctx - q * (q - 1) / 2  # causal: query i sees ctx − q + i + 1 positions
        core_flops += 4.0 * args.n_heads * args.head_dim * pairs  # QK^T and PV
        core_bytes += ctx * 2.0 * args.kv_dim * dtype_bytes  # read K and V once (flash-style)
        core_bytes += q * 2.0 * args.kv_dim * dtype_bytes  # write the new K and V
    core_bytes += n_tokens * 2.0 * args.q_dim * dtype_bytes  # read Q, write the output
    core = OperatorWork(flops=core_flops, bytes_moved=core_bytes, kind=f"{kind}.core")
    out = _gemm(f"{kind}.o", n_tokens, args.q_dim, args.dim, dtype_bytes)
    return _compose(kind, [qkv, core, out])


def experts_touched(args: ModelArgs, n_tokens: int) -> int:
    """Upper bound on the experts a microbatch activates: every token picks top-k."""
    return min(args.n_experts, n_tokens * args.n_experts_per_tok)


def ffn_work(args: ModelArgs, n_tokens: int, dtype_bytes: int = 2, layer: int | None = None,
             phase: str | None = None) -> ComposedWork:
    """One layer's FFN half: a dense SwiGLU, or the MoE (router + the experts the tokens touch, at
    most `experts_touched`). `layer` picks dense vs MoE in models with both (default: MoE when the
    model has experts). The FFN cannot tell the phase from the tokens; pass `phase` ("prefill" or
    "decode") to get kind "ffn.<phase>", else the kind is "ffn"."""
    kind = f"ffn.{phase}" if phase else "ffn"
    moe = args.n_experts > 0 and (layer is None or args.is_moe_layer(layer))
    if not moe:
        return _compose(kind, [_gemm(f"{kind}.swiglu", n_tokens, args.dim, args.intermediate_size, dtype_bytes, 3)])
    router = _gemm(f"{kind}.router", n_tokens, args.dim, args.n_experts, dtype_bytes)
    touched = experts_touched(args, n_tokens)
    routed = n_tokens * args.n_experts_per_tok  # token-expert pairs
    flops = 2.0 * routed * args.dim * args.moe_intermediate_size * 3
    weights = float(touched) * args.dim * args.moe_intermediate_size * 3 * dtype_bytes
    activations = routed * (args.dim * 2 + args.moe_intermediate_size * 3) * float(dtype_bytes)
    experts = OperatorWork(flops=flops, bytes_moved=weights + activations, kind=f"{kind}.experts")
    return _compose(kind, [router, experts])


def lm_head_work(args: ModelArgs, n_tokens: int, dtype_bytes: int = 2) -> ComposedWork:
    """The final projection to the vocabulary for `n_tokens` rows (fp32 logits written)."""
    head = _gemm("lm_head", n_tokens, args.dim, args.vocab_size, dtype_bytes)
    logits = float(n_tokens) * args.vocab_size * (4 - dtype_bytes)  # the fp32 logits, beyond the bf16 output
    return _compose("lm_head", [OperatorWork(head.flops, head.bytes_moved + logits, "lm_head")])

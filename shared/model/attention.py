"""The attention half of the split model.

It owns everything that touches the token stream and the KV cache: the embeddings, every layer's
attention (with its input norm, and the fused residual add + post-attention norm that produces
the FFN's input), the final norm, the lm_head. The residual stream never leaves this half: the
FFN half receives only the normalised FFN input and returns only its output (see seam.py).

Module and parameter names mirror the HF layout (`layers.N.self_attn.q_proj`), so checkpoint
names map on by a prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shared.model.config import ModelArgs
from shared.model.cpu_kernels import CPUKernels, load_kernels
from shared.model.layers import RMSNorm, RotaryEmbedding, apply_rope
from shared.model.sharding import WHOLE, Sharding, attention_args
from shared.model.split_point import add_rms_norm


class PagedKVStore:
    """K and V of every layer in a flat slot dimension: slot = block_id * block_size + offset.

    The block bookkeeping (which slots a sequence owns) lives in kv_cache.BlockTables; this
    class only holds the tensors.
    """

    def __init__(self, args: ModelArgs, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_slots, args.n_kv_heads, args.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.num_slots = num_slots

    def copy_blocks(self, copies: list[tuple[int, int]], block_size: int) -> None:
        """Copy-on-write: every layer's K/V of each (source, destination) block, before a pass writes."""
        if not copies:
            return
        device = self.k[0].device
        src = torch.tensor([b * block_size + i for b, _ in copies for i in range(block_size)], device=device)
        dst = torch.tensor([b * block_size + i for _, b in copies for i in range(block_size)], device=device)
        for cache in (*self.k, *self.v):
            cache.index_copy_(0, dst, cache.index_select(0, src))  # [S, Hkv, hd] rows


def gather_slots(cache: Tensor, slots: Tensor) -> Tensor:
    """cache [S, Hkv, hd] rows at `slots` [...]: -> [..., Hkv, hd].

    An embedding lookup over the flattened rows: the same copy as `cache[slots]`, about 7x faster
    on the CPU than advanced indexing (measured at 16 x 100 slots), which matters because every
    layer gathers its context once per step.
    """
    rows = F.embedding(slots, cache.view(cache.shape[0], -1))  # [..., Hkv * hd]
    return rows.view(*slots.shape, *cache.shape[1:])


def decode_kernel_fits(q: Tensor, k_cache: Tensor) -> bool:
    """Whether cpu_kernels' decode attention takes these: float32, head size 16..128 in steps of 16."""
    head_dim = q.shape[-1]
    return (q.dtype == torch.float32 and k_cache.dtype == torch.float32 and k_cache.is_contiguous()
            and head_dim % 16 == 0 and 16 <= head_dim <= 128)


@dataclass(frozen=True)
class SequencePass:
    """One sequence's share of a forward pass."""

    start_pos: int  # tokens of this sequence already in the KV cache
    n_new: int  # tokens it feeds in this pass (prompt chunk, or 1 when decoding)
    ctx_slots: list[int]  # KV slots of positions [0, start_pos + n_new)
    wants_logits: bool = True  # the pass ends at this sequence's last prompt token or a decode step


@dataclass
class PrefillGroup:
    row_start: int
    n_new: int
    gather: Tensor  # [ctx] slots of the whole context
    mask: Tensor | None  # [n_new, ctx] bool, None when the context is exactly the new tokens


@dataclass
class AttentionMeta:
    """Index tensors of one pass, built once and reused by every layer."""

    positions: Tensor  # [T] absolute positions of the pass's tokens
    write_slots: Tensor  # [T] KV slots the new K/V go to
    decode_rows: Tensor | None  # [Bd] rows of single-token sequences, None if all rows decode
    decode_gather: Tensor | None  # [Bd, C] context slots (padded with slot 0)
    decode_mask: Tensor | None  # [Bd, 1, 1, C] True where a key is part of the context
    decode_lengths: Tensor | None  # [Bd] context length of each decode row
    prefills: list[PrefillGroup]
    logits_rows: Tensor  # [B'] rows whose logits are sampled
    n_tokens: int
    kernels: CPUKernels | None = None  # decode attention straight from the cache (cpu_kernels.py)

    @classmethod
    def build(cls, seqs: list[SequencePass], device: torch.device) -> AttentionMeta:
        positions: list[int] = []
        write_slots: list[int] = []
        decode_rows: list[int] = []
        decode_ctx: list[list[int]] = []
        prefills: list[PrefillGroup] = []
        logits_rows: list[int] = []
        row = 0
        for seq in seqs:
            end = seq.start_pos + seq.n_new
            positions.extend(range(seq.start_pos, end))
            write_slots.extend(seq.ctx_slots[seq.start_pos:end])
            if seq.n_new == 1:
                decode_rows.append(row)
                decode_ctx.append(seq.ctx_slots[:end])
            else:
                mask = None
                if seq.start_pos > 0:
                    key_pos = torch.arange(end, device=device)
                    query_pos = torch.arange(seq.start_pos, end, device=device)
                    mask = key_pos[None, :] <= query_pos[:, None]
                gather = torch.tensor(seq.ctx_slots[:end], dtype=torch.long, device=device)
                prefills.append(PrefillGroup(row, seq.n_new, gather, mask))
            if seq.wants_logits:
                logits_rows.append(row + seq.n_new - 1)
            row += seq.n_new
        d_rows = d_gather = d_mask = lengths = None
        if decode_ctx:
            longest = max(len(c) for c in decode_ctx)
            d_gather = torch.tensor([c + [0] * (longest - len(c)) for c in decode_ctx], device=device)
            lengths = torch.tensor([len(c) for c in decode_ctx], device=device)
            d_mask = (torch.arange(longest, device=device)[None, :] < lengths[:, None])[:, None, None, :]
            if len(decode_rows) != row:
                d_rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
        return cls(
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            write_slots=torch.tensor(write_slots, dtype=torch.long, device=device),
            decode_rows=d_rows,
            decode_gather=d_gather,
            decode_mask=d_mask,
            decode_lengths=lengths,
            prefills=prefills,
            logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=device),
            n_tokens=row,
            kernels=load_kernels() if device.type == "cpu" else None,
        )


class SelfAttention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.dim, args.q_dim, bias=args.attention_bias)
        self.k_proj = nn.Linear(args.dim, args.kv_dim, bias=args.attention_bias)
        self.v_proj = nn.Linear(args.dim, args.kv_dim, bias=args.attention_bias)
        self.o_proj = nn.Linear(args.q_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.qkv_proj: nn.Module | None = None  # q, k and v fused in one Int8Linear (quantize_int8)

    def quantize_int8(self) -> None:
        """Fuse q/k/v into one W8A8 product (one input quantisation), and o_proj W8A8."""
        from shared.model.quant import Int8Linear, fuse_int8

        self.qkv_proj = fuse_int8([self.q_proj, self.k_proj, self.v_proj])
        # o_proj's input (attention outputs) has no outlier channels to spread: measured on SmolLM2,
        # rotating it changes nothing (top-1 agreement with float32 95.1% unrotated vs 94.3%)
        self.o_proj = Int8Linear.from_linear(self.o_proj, rotate=False)  # type: ignore[assignment]
        del self.q_proj, self.k_proj, self.v_proj

    def project_qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # x: [T, D] -> q: [T, H, hd], k, v: [T, Hkv, hd], RoPE applied to q and k
        n_tokens = x.shape[0]
        if self.qkv_proj is not None:
            heads = self.n_heads + 2 * self.n_kv_heads
            qkv = cast(Tensor, self.qkv_proj(x)).view(n_tokens, heads, self.head_dim)  # [T, H + 2 Hkv, hd]
            if self.q_norm is None:  # RoPE on q and k in one pass
                qk = apply_rope(qkv[:, :self.n_heads + self.n_kv_heads], cos, sin)
                return qk[:, :self.n_heads], qk[:, self.n_heads:], qkv[:, self.n_heads + self.n_kv_heads:]
            q, k, v = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(n_tokens, self.n_heads, self.head_dim)
        k = k.reshape(n_tokens, self.n_kv_heads, self.head_dim)
        v = v.reshape(n_tokens, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMeta,
                k_cache: Tensor, v_cache: Tensor) -> Tensor:
        # x: [T, D]; caches: [slots, Hkv, hd]
        q, k, v = self.project_qkv(x, cos, sin)
        k_cache.index_copy_(0, meta.write_slots, k)
        v_cache.index_copy_(0, meta.write_slots, v)
        out = torch.empty_like(q)  # [T, H, hd]
        if meta.decode_gather is not None:
            rows = meta.decode_rows
            q_dec = q if rows is None else q[rows]  # [Bd, H, hd]
            if meta.kernels is not None and decode_kernel_fits(q_dec, k_cache):
                assert meta.decode_lengths is not None
                o = meta.kernels.decode_attention(q_dec, k_cache, v_cache, meta.decode_gather, meta.decode_lengths)
            else:
                k_ctx = gather_slots(k_cache, meta.decode_gather).transpose(1, 2)  # [Bd, Hkv, C, hd]
                v_ctx = gather_slots(v_cache, meta.decode_gather).transpose(1, 2)
                o = F.scaled_dot_product_attention(q_dec.unsqueeze(2), k_ctx, v_ctx, attn_mask=meta.decode_mask,
                                                   enable_gqa=True).squeeze(2)  # [Bd, H, hd]
            if rows is None:
                out = o
            else:
                out[rows] = o
        for group in meta.prefills:
            rows_slice = slice(group.row_start, group.row_start + group.n_new)
            q_seq = q[rows_slice].transpose(0, 1)  # [H, n, hd]
            if group.mask is None:  # context == the new tokens: attend to them directly
                k_seq, v_seq = k[rows_slice].transpose(0, 1), v[rows_slice].transpose(0, 1)
            else:
                k_seq = gather_slots(k_cache, group.gather).transpose(0, 1)  # [Hkv, ctx, hd]
                v_seq = gather_slots(v_cache, group.gather).transpose(0, 1)
            o = F.scaled_dot_product_attention(q_seq.unsqueeze(0), k_seq.unsqueeze(0), v_seq.unsqueeze(0),
                                               attn_mask=group.mask, is_causal=group.mask is None,
                                               enable_gqa=True)
            out[rows_slice] = o.squeeze(0).transpose(0, 1)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def forward_contiguous(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Plain causal attention over one whole sequence, no cache: the unsplit reference path."""
        q, k, v = self.project_qkv(x, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
        return self.o_proj(o[0].transpose(0, 1).reshape(x.shape[0], -1))


class AttentionBlock(nn.Module):
    """Layer l's attention side: input norm, attention, residual add, post-attention norm."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = SelfAttention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)


class AttentionHalf(nn.Module):
    """Embeddings, all layers' attention, final norm and lm_head.

    Built for one rank of a tensor-parallel group (`sharding`), it holds that rank's heads (sharding.py)
    and `args` is the share's shape; `reduce` (the group's all-reduce, set by the group) sums the ranks'
    o_proj outputs. The residual stream, norms, embeddings and lm_head are whole on every rank.
    """

    def __init__(self, args: ModelArgs, sharding: Sharding = WHOLE) -> None:
        super().__init__()
        self.sharding = sharding
        self.args = args = attention_args(args, sharding)
        self.reduce: Callable[[Tensor], Tensor] | None = None
        # no init: every half is built on the meta device and filled (from a checkpoint, or randomly by the
        # benchmarks); nn.Embedding's own normal_ init on meta imports ~800 torch modules, 0.9 s a process
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim, _weight=torch.empty(args.vocab_size, args.dim))
        self.layers = nn.ModuleList(AttentionBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.logits_head: nn.Module | None = None  # an Int8Linear once quantised (see quantize_int8)
        with torch.device("cpu"):
            self.rotary = RotaryEmbedding(args)

    def quantize_int8(self) -> None:
        """W8A8 for every projection and the lm_head (tied or not); norms and embeddings stay float."""
        from shared.model.quant import Int8Linear

        for layer in range(self.args.n_layers):
            self.block(layer).self_attn.quantize_int8()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.logits_head = Int8Linear(weight)
        self.lm_head = None  # its float weights are no longer read

    @property
    def weight_bytes(self) -> int:
        """Bytes per projection weight, for the GPU model: 1 once quantised, else the float dtype's."""
        return 1 if self.logits_head is not None else self.embed_tokens.weight.element_size()

    def block(self, layer: int) -> AttentionBlock:
        return cast(AttentionBlock, self.layers[layer])

    def embed(self, tokens: Tensor) -> Tensor:
        # tokens: [T] -> residual: [T, D]
        return self.embed_tokens(tokens)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.rotary(positions, self.embed_tokens.weight.dtype)

    def attend(self, layer: int, residual: Tensor, ffn_out: Tensor | None, rope: tuple[Tensor, Tensor],
               meta: AttentionMeta, kv: PagedKVStore) -> tuple[Tensor, Tensor]:
        """Layer `layer`'s attention side; returns (residual, ffn_in) where ffn_in goes to the FFN.

        `ffn_out` is the previous layer's FFN output (None at layer 0); its residual add and this
        layer's input norm are fused.
        """
        block = self.block(layer)
        if ffn_out is None:
            x = block.input_layernorm(residual)
        else:
            residual, x = add_rms_norm(residual, ffn_out, block.input_layernorm)
        attn_out = block.self_attn(x, rope[0], rope[1], meta, kv.k[layer], kv.v[layer])  # [T, D]
        if self.sharding.size > 1:  # this rank's heads' share: the group's sum is the layer's output
            if self.reduce is None:
                raise RuntimeError("a sharded attention half runs only inside its group (reduce is not set)")
            attn_out = self.reduce(attn_out)
        residual, ffn_in = add_rms_norm(residual, attn_out, block.post_attention_layernorm)
        return residual, ffn_in

    def logits(self, residual: Tensor, ffn_out: Tensor, rows: Tensor) -> Tensor:
        """Last layer's residual add, final norm and lm_head, for the rows that sample: [B', V]."""
        hidden = (residual[rows] + ffn_out[rows]) if rows.numel() != residual.shape[0] else residual + ffn_out
        return self.project_logits(self.norm(hidden))

    def project_logits(self, hidden: Tensor) -> Tensor:
        # hidden: [B, D] (final-normed) -> logits [B, V] float32
        if self.logits_head is not None:
            return cast(Tensor, self.logits_head(hidden)).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

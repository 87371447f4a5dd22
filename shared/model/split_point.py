"""Where the model is split: what crosses between the attention half and the FFN half, and the fused norm.

For every layer l, exactly one tensor crosses each way:

    attention -> FFN:  ffn_in[l]  = post_attention_norm(residual + attn_out)   [T, D]
    FFN -> attention:  ffn_out[l] = FFN_l(ffn_in[l])                           [T, D]

The residual stream (the running sum of the layer outputs) stays on the attention side: the
attention worker adds `ffn_out[l]` to it and applies layer l+1's input norm in one fused step
(`add_rms_norm`), and after the last layer it adds the final `ffn_out` before the final norm.
Keeping the residual home halves the bytes on the wire compared with shipping
(hidden, residual) both ways, and leaves the FFN half stateless: it can serve any attention
worker and merge microbatches of the same layer. The wire protocol carries these tensors only,
with a header (`shared/transport/header.py`, `SeamHeader`) saying which microbatch, layer and rows
they belong to.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class _Norm(Protocol):
    def __call__(self, x: Tensor) -> Tensor: ...


def add_rms_norm(residual: Tensor, delta: Tensor, norm: _Norm) -> tuple[Tensor, Tensor]:
    """residual += delta, then normalise: returns (new residual, normed input of the next op)."""
    residual = residual + delta
    return residual, norm(residual)

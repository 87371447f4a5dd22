"""The FFN half of the split model: every layer's SwiGLU MLP or mixture of experts.

It is stateless between calls: it gets a layer's normalised FFN input [T, D] and returns the
FFN output [T, D] (see seam.py), so one FFN worker can serve any attention worker, and rows of
several microbatches of the same layer can be stacked into one matrix product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shared.model.config import ModelArgs
from shared.model.layers import SwiGLU


class MoE(nn.Module):
    """Top-k routed experts: softmax over all experts, keep k, optionally renormalise.

    Mixtral always renormalises the kept weights; Qwen3-MoE does when `norm_topk_prob`.
    Sum order follows the HF reference (experts in index order, index_add into the output).
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.n_experts_per_tok
        self.renormalise = args.norm_topk_prob
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(args.dim, args.moe_intermediate_size)
                                     for _ in range(args.n_experts))

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, D]; T = tokens, E = experts, K = experts per token
        router_logits = self.gate(x)  # [T, E]
        weights = F.softmax(router_logits, dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)  # [T, K]
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        expert_mask = F.one_hot(chosen, num_classes=len(self.experts)).permute(2, 1, 0)  # [E, K, T]
        for expert_id in torch.nonzero(expert_mask.sum(dim=(1, 2))).flatten().tolist():
            slot, token = torch.where(expert_mask[expert_id])
            expert_out = self.experts[expert_id](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, expert_out.to(x.dtype))
        return out


class FFNHalf(nn.Module):
    """All layers' FFNs; `forward(layer, ffn_in)` runs one layer."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        # what callers must feed and what the GPU model reads per weight (set by the loader; int8: 1 byte)
        self.activation_dtype, self.device, self.weight_bytes = torch.float32, torch.device("cpu"), 4
        self.layers = nn.ModuleList(
            MoE(args) if args.is_moe_layer(i) else SwiGLU(args.dim, args.intermediate_size)
            for i in range(args.n_layers)
        )

    def quantize_int8(self) -> None:
        """W8A8 for every expert and dense MLP projection; MoE routers (`gate`) stay float."""
        for module in self.modules():
            if isinstance(module, SwiGLU):
                module.quantize_int8()
        self.weight_bytes = 1

    def fuse_gate_up(self) -> None:
        """The dense layers' gate and up as one product each (`SwiGLU.fuse_gate_up`: bit-equal)."""
        for layer in self.layers:
            if isinstance(layer, SwiGLU):
                layer.fuse_gate_up()

    def forward(self, layer: int, ffn_in: Tensor) -> Tensor:
        # ffn_in: [T, D] -> ffn_out: [T, D]
        return self.layers[layer](ffn_in)

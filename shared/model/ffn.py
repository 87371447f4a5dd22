"""The FFN half of the split model: every layer's SwiGLU MLP or mixture of experts.

It is stateless between calls: it gets a layer's normalised FFN input [T, D] and returns the
FFN output [T, D] (see seam.py), so one FFN worker can serve any attention worker, and rows of
several microbatches of the same layer can be stacked into one matrix product.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shared.model.config import ModelArgs
from shared.model.layers import SwiGLU
from shared.model.sharding import WHOLE, Sharding, ffn_args, held_experts


class MoE(nn.Module):
    """Top-k routed experts: softmax over all experts, keep k, optionally renormalise.

    Mixtral always renormalises the kept weights; Qwen3-MoE does when `norm_topk_prob`.
    Sum order follows the HF reference (experts in index order, index_add into the output). A rank of an
    expert-parallel group holds only `experts` (keyed by their global ids, so checkpoint names map on)
    and returns their share of the output; the group's all-reduce adds the shares.
    """

    def __init__(self, args: ModelArgs, experts: range | None = None) -> None:
        super().__init__()
        self.top_k = args.n_experts_per_tok
        self.renormalise = args.norm_topk_prob
        self.n_experts = args.n_experts
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)
        held = range(args.n_experts) if experts is None else experts
        self.experts = nn.ModuleDict({str(e): SwiGLU(args.dim, args.moe_intermediate_size) for e in held})

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, D]; T = tokens, E = experts, K = experts per token
        router_logits = self.gate(x)  # [T, E]
        weights = F.softmax(router_logits, dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)  # [T, K]
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        expert_mask = F.one_hot(chosen, num_classes=self.n_experts).permute(2, 1, 0)  # [E, K, T]
        for expert_id in torch.nonzero(expert_mask.sum(dim=(1, 2))).flatten().tolist():
            if str(expert_id) not in self.experts:  # another rank of the expert-parallel group holds it
                continue
            slot, token = torch.where(expert_mask[expert_id])
            expert_out = self.experts[str(expert_id)](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, expert_out.to(x.dtype))
        return out


class FFNHalf(nn.Module):
    """All layers' FFNs; `forward(layer, ffn_in)` runs one layer.

    Built for one rank of a group (`sharding`), it holds that rank's share (sharding.py) and `args` is the
    share's shape; `reduce` (the group's all-reduce, set by the group) sums the ranks' partial outputs.
    """

    def __init__(self, args: ModelArgs, sharding: Sharding = WHOLE) -> None:
        super().__init__()
        self.sharding = sharding
        self.args = args = ffn_args(args, sharding)
        self.reduce: Callable[[Tensor], Tensor] | None = None
        # what callers must feed and what the GPU model reads per weight (set by the loader; int8: 1 byte)
        self.activation_dtype, self.device, self.weight_bytes = torch.float32, torch.device("cpu"), 4
        experts = held_experts(args, sharding)
        self.layers = nn.ModuleList(
            MoE(args, experts) if args.is_moe_layer(i) else SwiGLU(args.dim, args.intermediate_size)
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
        # ffn_in: [T, D] -> ffn_out: [T, D] (this rank's partial sum, then the group's total)
        out = self.layers[layer](ffn_in)
        if self.sharding.size > 1:
            if self.reduce is None:
                raise RuntimeError("a sharded FFN half runs only inside its group (reduce is not set)")
            out = self.reduce(out)
        return out

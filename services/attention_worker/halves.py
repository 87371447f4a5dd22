"""What an attention worker, or one rank of its group, holds: its share of the attention half, of the FFN half
too with `colocate`, and its KV cache; loaded in one blocking call (services run it in a thread)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker_base.loading import load_half, parameter_bytes
from shared.model.attention import AttentionHalf, PagedKVStore
from shared.model.checkpoint import Checkpoint
from shared.model.cpu_kernels import load_kernels
from shared.model.ffn import FFNHalf
from shared.settings import AttentionWorkerSettings
from shared.transport.device_group import DeviceGroup


@dataclass
class Halves:
    checkpoint: Checkpoint
    model: AttentionHalf
    ffn: FFNHalf | None  # `colocate`: for microbatches it runs whole
    kv: PagedKVStore

    @property
    def weight_bytes(self) -> int:
        return parameter_bytes(self.model) + (parameter_bytes(self.ffn) if self.ffn is not None else 0)

    def reduce_over(self, group: DeviceGroup) -> None:
        """A group's shares sum their partial layer outputs over it."""
        self.model.reduce = group.all_reduce
        if self.ffn is not None:
            self.ffn.reduce = group.all_reduce


def load_halves(settings: AttentionWorkerSettings) -> Halves:
    """This rank's halves (all of them outside a group) and its KV cache, the CPU kernels loaded (blocking)."""
    checkpoint, model = load_half(settings, AttentionHalf)
    ffn = None
    if settings.colocate:
        _, ffn = load_half(settings, FFNHalf)
        with torch.inference_mode():  # the FFN's first forward loads its CPU kernels (seconds): here, in the load
            # thread (this rank's share alone: a group's all-reduce waits for the group to form)
            ffn.layers[0](torch.zeros(1, ffn.args.dim, device=ffn.device, dtype=ffn.activation_dtype))
    weight = model.embed_tokens.weight
    if weight.device.type == "cpu":  # the attention kernels build on first use (~30 s where no build is cached):
        load_kernels()  # here, in the load thread, not on the event loop's first forward, where heartbeats stop
    kv = PagedKVStore(model.args, settings.num_kv_blocks * settings.block_size, weight.dtype, weight.device)
    return Halves(checkpoint, model, ffn, kv)

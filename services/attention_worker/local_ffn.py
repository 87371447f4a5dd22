"""A colocated attention worker's FFN: the same call as a seam hop (`FFNHops.round_trip`), run here.

An attention worker started with `colocate` also loads the FFN half. When the global scheduler assigns
it `colocated`, its microbatches name the worker itself as their FFN worker, and `forward` takes each
layer's FFN from this path instead of a round trip: the whole model on one GPU, no seam, no FFN
worker (DynamoLLM's replicas, the simulator's "colocated" plan). The FFN runs on the worker's own GPU
at the phase's clock and is accounted there by the FFN worker's own call (`ffn_forward`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import Tensor

from services.attention_worker.follower import FFN
from services.worker_base.ffn_forward import ffn_forward
from services.worker_base.gpu import WorkerGPU
from shared.kinds import clock_phase
from shared.messages import MicrobatchDescriptor
from shared.model.ffn import FFNHalf
from shared.transport.device_group import DeviceGroup, leading


class FFNPath(Protocol):
    """Where a layer's FFN runs: over the seam on an FFN worker, or here."""

    async def round_trip(self, desc: MicrobatchDescriptor, layer: int, ffn_in: Tensor,
                         while_waiting: Callable[[], None] | None = None, *, block: bool = False
                         ) -> tuple[Tensor, float, float]:
        """Layer `layer`'s ffn_out for `ffn_in`, the energy of its FFN forward, and that forward's time."""
        ...


class LocalFFN:
    """This worker's FFN half; in a group, every rank's share of it (the followers' over their own copy of the
    FFN input: follower.py)."""

    def __init__(self, model: FFNHalf, worker_gpu: WorkerGPU, group: DeviceGroup | None = None) -> None:
        self.model, self.worker_gpu, self.group = model, worker_gpu, group

    async def round_trip(self, desc: MicrobatchDescriptor, layer: int, ffn_in: Tensor,
                         while_waiting: Callable[[], None] | None = None, *, block: bool = False
                         ) -> tuple[Tensor, float, float]:
        if while_waiting is not None:  # the attention layer's accounting first, as on the seam path
            while_waiting()
        phase = clock_phase(desc.phase)
        with leading(self.group, FFN, mb_id=desc.mb_id, layer=layer, phase=phase):
            out, energy_j, measured_s = ffn_forward(self.model, self.worker_gpu, layer, phase, ffn_in)
        return out.to(dtype=ffn_in.dtype), energy_j, measured_s

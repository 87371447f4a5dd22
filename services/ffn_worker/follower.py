"""A rank > 0 of an FFN group: its share of every FFN forward its rank 0 runs, on its own device and clock.

It has no NATS connection: rank 0 takes the frames, and before each forward sends the layer, the phase,
its clock command and the rows (`lead_ffn`); every rank runs its share through the same `ffn_forward`
(the shard's work on its own GPU, at the same clock) and the layer's all-reduce sums the shares. The
step's energy is summed over the ranks too, so a frame's reply carries the whole group's.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from services.worker_base.ffn_forward import ffn_forward
from services.worker_base.gpu import WorkerGPU
from services.worker_base.loading import load_half
from services.worker_base.rank_group import clock_state, follow_clocks, follow_commands
from shared.kinds import ClockPhase
from shared.model.ffn import FFNHalf
from shared.settings import FFNWorkerSettings
from shared.transport.device_group import Command, DeviceGroup

log = logging.getLogger("aflex.ffn_worker")

FFN = "ffn"
RELEASE = "release"  # rank 0 parked cold: drop the weights
LOAD = "load"  # and loads them again


def lead_ffn(group: DeviceGroup, model: FFNHalf, worker_gpu: WorkerGPU, layer: int, phase: ClockPhase, x: Tensor
             ) -> tuple[Tensor, float, float]:
    """Rank 0: layer `layer`'s FFN over `x` [T, D] on every rank of the group (`ffn_forward`'s returns, with
    the group's energy)."""
    with group.step(FFN, [x], layer=layer, phase=phase, clock=clock_state(worker_gpu)):
        out, energy_j, measured_s = ffn_forward(model, worker_gpu, layer, phase, x)
        return out, group.sum_float(energy_j), measured_s


def follow(settings: FFNWorkerSettings) -> None:
    """Rank `group_rank`'s life: load its share, join the group, do what rank 0 says until it stops or goes."""
    rank, size = settings.group_rank, settings.group_size
    _, model = load_half(settings, FFNHalf)
    worker_gpu = WorkerGPU(settings, settings.worker_id, "ffn")
    worker_gpu.controller.reset()
    group = DeviceGroup.join(settings.group_address, rank, size, torch.device(settings.device),
                             settings.group_timeout_s)
    model.reduce = group.all_reduce
    log.info("ffn group rank %d of %d joined %s on %s (%s)", rank, size, settings.group_address, settings.device,
             "gloo + nccl" if group.nccl is not None else "gloo")
    held: FFNHalf | None = model

    def do(command: Command) -> None:
        nonlocal held
        if command.op == RELEASE:
            held = None
        elif command.op == LOAD:
            _, held = load_half(settings, FFNHalf)
            held.reduce = group.all_reduce
            group.barrier(command.args["tag"])
        elif command.op == FFN:
            assert held is not None, "rank 0 sent a forward to a rank that released its weights"
            args = command.args
            follow_clocks(worker_gpu, args["clock"])
            _, energy_j, _ = ffn_forward(held, worker_gpu, args["layer"], args["phase"], command.tensors[0])
            group.sum_float(energy_j)
        else:
            log.warning("ffn group rank %d: unknown command %r", rank, command.op)

    follow_commands(group, worker_gpu, do)

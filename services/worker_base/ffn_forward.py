"""One FFN forward, run and accounted on the worker's GPU: the FFN worker's per-hop forward and a colocated
attention worker's own FFN (`services/attention_worker/local_ffn.py`) are this one call."""

from __future__ import annotations

import time

import torch
from torch import Tensor

from services.worker_base.gpu import WorkerGPU
from shared.gpu.workload import ffn_work
from shared.kinds import ClockPhase
from shared.model.ffn import FFNHalf


def ffn_forward(model: FFNHalf, worker_gpu: WorkerGPU, layer: int, phase: ClockPhase, x: Tensor
                ) -> tuple[Tensor, float, float]:
    """Layer `layer`'s FFN over `x` [T, D] at `phase`'s clock: the output [T, D] (the model's activation dtype),
    the GPU energy of the forward (J) and its measured seconds; the meter counts the op."""
    gpu = worker_gpu.gpu
    worker_gpu.controller.before_microbatch(phase)
    energy0 = gpu.total_energy_j()
    started = time.perf_counter()
    with torch.inference_mode():
        out = model(layer, x.to(device=model.device, dtype=model.activation_dtype))  # [T, D]
    measured_s = time.perf_counter() - started
    modelled_s = gpu.run(ffn_work(model.args, x.shape[0], dtype_bytes=model.weight_bytes, layer=layer, phase=phase),
                         measured_s)
    worker_gpu.meter.op(phase, measured_s, modelled_s)
    return out, gpu.total_energy_j() - energy0, measured_s

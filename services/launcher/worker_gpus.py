"""What `aflex up` does about GPUs: one per worker where the host has enough, and a dead worker's clock reset."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from services.launcher.children import ChildDeathHook, ChildExit, ChildSpec
from shared.settings_flags import env_name

WORKER_ROLES = frozenset({"attention-worker", "ffn-worker"})


def device_env(device: str | None) -> dict[str, str]:
    return {} if device is None else {"CUDA_VISIBLE_DEVICES": device}


def worker_devices(sizes: Sequence[int]) -> list[str | None]:
    """Each worker's GPUs (`CUDA_VISIBLE_DEVICES`: one per rank of a group of `sizes[i]`) when the host has
    enough (so each runs at its own clock), else None each.

    With fewer GPUs than ranks nothing is pinned: the workers share what CUDA_VISIBLE_DEVICES
    shows them, and a clock command of one moves the clock of the others on the same GPU.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                ids = [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
            finally:
                pynvml.nvmlShutdown()
        except Exception:  # no NVML library or driver: no GPUs to pin
            ids = []
    if len(ids) < sum(sizes):
        return [None] * len(sizes)
    firsts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [",".join(ids[first:first + size]) for first, size in zip(firsts, sizes, strict=True)]


def reset_clock_hook(specs: Sequence[ChildSpec]) -> ChildDeathHook:
    """A hook that resets the SM clock of a dead worker that was setting clocks (`--gpu-control nvml`, or
    an emulated GPU with a `gpu_state_dir`).

    A worker resets its clock on a clean exit; one that crashed or was killed cannot, and would
    leave its GPU locked at whatever clock it last set.
    """
    by_name = {spec.name: spec for spec in specs}

    def setting(spec: ChildSpec, name: str) -> str:
        return spec.env.get(env_name(name), os.environ.get(env_name(name), ""))

    def reset(exit_: ChildExit) -> None:
        spec = by_name.get(exit_.name)
        if spec is None or spec.role not in WORKER_ROLES:
            return
        backend, state_dir = setting(spec, "gpu_backend"), setting(spec, "gpu_state_dir")
        if backend == "emulated" and state_dir:  # an emulated GPU whose lock outlives its worker
            from shared.gpu.emulated import write_locked_mhz

            write_locked_mhz(Path(state_dir) / f"{exit_.name}.json", None)
            print(f"aflex up: reset the emulated GPU clock of {exit_.name}", file=sys.stderr, flush=True)
            return
        if backend != "nvml":
            return  # of the real backends only `--gpu-control nvml` sets clocks; nvml-readonly leaves none
        from shared.gpu.base import GPUError
        from shared.gpu.nvml import NvmlGPU

        device = spec.env.get("CUDA_VISIBLE_DEVICES")
        indexes: list[int | None] = [None] if device is None else [int(d) for d in device.split(",") if d.strip()]
        for index in indexes:  # every rank's GPU of a group
            try:
                gpu = NvmlGPU(index=index)
                try:
                    gpu.reset_sm_clock()
                finally:
                    gpu.close()
                print(f"aflex up: reset the GPU clock of {exit_.name} (GPU {index})", file=sys.stderr, flush=True)
            except (GPUError, ValueError) as exc:
                print(f"aflex up: could not reset the GPU clock of {exit_.name}: {exc}", file=sys.stderr,
                      flush=True)

    return reset

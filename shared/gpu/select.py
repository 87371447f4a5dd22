"""Pick a worker's GPU backend.

"auto" reads a real GPU through NVML without ever setting its clocks (nvml-readonly) when NVML
initialises, else emulates the profile. Clocks are set only when "nvml" is asked for explicitly.
"""

from __future__ import annotations

from pathlib import Path

from shared.gpu.base import GPU, GPUError

BACKENDS = ("auto", "nvml", "nvml-readonly", "emulated")


def select_gpu(backend: str = "auto", profile: str | Path = "a800", pace: bool = False,
               index: int | None = None, device_file: Path | None = None) -> GPU:
    if backend not in BACKENDS:
        raise GPUError(f"unknown GPU backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "emulated":
        from shared.gpu.emulated import EmulatedGPU

        return EmulatedGPU(profile, pace=pace, device_file=device_file)
    from shared.gpu.nvml import NvmlGPU

    if backend == "auto":
        try:
            return NvmlGPU(index, readonly=True)
        except GPUError:
            return select_gpu("emulated", profile, pace, device_file=device_file)
    try:
        return NvmlGPU(index, readonly=backend == "nvml-readonly")
    except GPUError as exc:
        raise type(exc)(f"GPU backend {backend!r} is unavailable: {exc}") from exc

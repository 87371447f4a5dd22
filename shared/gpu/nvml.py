"""A real NVIDIA GPU through NVML (`nvidia-ml-py`, module `pynvml`, imported when first needed).

`NvmlGPU(readonly=False)` locks the SM clock with nvmlDeviceSetGpuLockedClocks(h, f, f), which
needs root or CAP_SYS_ADMIN (compose: `cap_add: [SYS_ADMIN]`). `readonly=True` never calls a
setter: a clock request is recorded and reported as not applied (for shared GPUs). Every NVML error
becomes a typed `GPUError`; the NVML error is kept as `__cause__`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from shared.gpu.base import GPU, ClockResult, GPUError, GPUNotSupportedError, GPUPermissionError

PERMISSION_HINT = (
    "setting GPU clocks needs root or the CAP_SYS_ADMIN capability (in compose: cap_add: [SYS_ADMIN] on the "
    "worker service); use the nvml-readonly backend to only read"
)


def _import_pynvml() -> Any:
    try:
        import pynvml
    except ImportError as exc:
        raise GPUError("NVML is unavailable: install nvidia-ml-py (module pynvml)") from exc
    if not hasattr(pynvml, "_nvmlGetFunctionPointer"):
        raise GPUError("the unofficial pynvml package is installed: pip uninstall pynvml; pip install nvidia-ml-py")
    return pynvml


def visible_devices(env: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of entries (indices or UUIDs); None when unset."""
    if env is None:
        return None
    entries = [e.strip() for e in env.split(",")]
    if not env.strip() or not entries[0]:
        raise GPUError("CUDA_VISIBLE_DEVICES is empty: no GPU is visible to this process")
    out: list[str] = []
    for e in entries:  # CUDA stops at the first invalid entry
        if not e or e == "-1":
            break
        if e.startswith("MIG-"):
            raise GPUError(f"CUDA_VISIBLE_DEVICES names a MIG slice ({e}); NVML cannot measure or clock MIG slices")
        out.append(e)
    if not out:
        raise GPUError(f"CUDA_VISIBLE_DEVICES={env!r} makes no GPU visible")
    return out


class NvmlGPU(GPU):
    """One GPU through NVML; `index` is the CUDA index (CUDA_VISIBLE_DEVICES honoured)."""

    def __init__(self, index: int | None = None, readonly: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._nvml = _import_pynvml()
        self.readonly = readonly
        self.backend = "nvml-readonly" if readonly else "nvml"
        self._clock = clock
        self._locked_mhz: int | None = None
        self._energy_counter: bool | None = None  # None: not probed yet
        self._integrated_j = 0.0
        self._last_sample: tuple[float, float] | None = None  # (time, W) for the fallback integral
        self._closed = False
        self._call("nvmlInit")
        try:
            self._handle = self._device_handle(index)
            name = self._call("nvmlDeviceGetName", self._handle)
            self.name = name.decode() if isinstance(name, bytes) else str(name)
            mem = self._call("nvmlDeviceGetSupportedMemoryClocks", self._handle)
            graphics = self._call("nvmlDeviceGetSupportedGraphicsClocks", self._handle, max(mem))
            self._clocks = sorted({int(c) for c in graphics})
            if not self._clocks:
                raise GPUError(f"{self.name} reports no supported graphics clocks")
        except BaseException:
            self.close()
            raise

    def _call(self, fn: str, *args: Any) -> Any:
        nvml = self._nvml
        try:
            return getattr(nvml, fn)(*args)
        except nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == nvml.NVML_ERROR_NO_PERMISSION:
                raise GPUPermissionError(f"{fn}: {exc}; {PERMISSION_HINT}") from exc
            if code == nvml.NVML_ERROR_NOT_SUPPORTED:
                raise GPUNotSupportedError(f"{fn} is not supported on this GPU or driver: {exc}") from exc
            raise GPUError(f"NVML call {fn} failed: {exc} (code {code})") from exc

    def _device_handle(self, index: int | None) -> Any:
        visible = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
        cuda_index = 0 if index is None else index
        if visible is None:
            if cuda_index < 0 or cuda_index >= self._call("nvmlDeviceGetCount"):
                raise GPUError(f"no GPU at index {cuda_index}")
            return self._call("nvmlDeviceGetHandleByIndex", cuda_index)
        if not 0 <= cuda_index < len(visible):
            raise GPUError(f"CUDA index {cuda_index} is out of range: CUDA_VISIBLE_DEVICES lists {len(visible)}")
        entry = visible[cuda_index]
        if entry.isdigit():
            return self._call("nvmlDeviceGetHandleByIndex", int(entry))
        uuid = entry if entry.startswith("GPU-") else f"GPU-{entry}"
        return self._call("nvmlDeviceGetHandleByUUID", uuid)

    # -- clocks -------------------------------------------------------------------------------
    def supported_sm_clocks_mhz(self) -> list[int]:
        return list(self._clocks)

    def sm_clock_mhz(self) -> int:
        return int(self._call("nvmlDeviceGetClockInfo", self._handle, self._nvml.NVML_CLOCK_SM))

    def set_sm_clock_mhz(self, clock_mhz: int) -> ClockResult:
        target = self.snap_clock_mhz(clock_mhz)
        if self.readonly:
            return ClockResult(clock_mhz, target, applied=False, reason="nvml-readonly: clocks are never set")
        if target == self._locked_mhz:
            return ClockResult(clock_mhz, target, applied=False, reason=f"already locked at {target} MHz")
        self._call("nvmlDeviceSetGpuLockedClocks", self._handle, target, target)
        self._locked_mhz = target
        return ClockResult(clock_mhz, target, applied=True)

    def reset_sm_clock(self) -> None:
        if self.readonly:
            return
        self._call("nvmlDeviceResetGpuLockedClocks", self._handle)
        self._locked_mhz = None

    # -- power and energy ---------------------------------------------------------------------
    def memory_bytes(self) -> float:
        try:
            return float(self._call("nvmlDeviceGetMemoryInfo", self._handle).total)
        except (GPUError, AttributeError):  # not supported, or a pynvml without the call: unknown
            return 0.0

    def power_w(self) -> float:
        return float(self._call("nvmlDeviceGetPowerUsage", self._handle)) / 1000.0

    def total_energy_j(self) -> float:
        if self._energy_counter is not False:
            try:
                mj = self._call("nvmlDeviceGetTotalEnergyConsumption", self._handle)
                self._energy_counter = True
                return float(mj) / 1000.0
            except GPUNotSupportedError:
                if self._energy_counter:
                    raise
                self._energy_counter = False
        # Fallback: trapezoidal integral of power over the calls to this method.
        now, watts = self._clock(), self.power_w()
        if self._last_sample is not None:
            t0, w0 = self._last_sample
            self._integrated_j += max(0.0, now - t0) * (w0 + watts) / 2.0
        self._last_sample = (now, watts)
        return self._integrated_j

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(GPUError):
            self._call("nvmlShutdown")

"""One GPU interface for every backend, with units in its names.

A worker holds one `GPU`: it reads clocks, power and energy for telemetry and energy accounting,
and sets its SM clock on the scheduler's command. Backends: `nvml` (sets locked SM clocks),
`nvml-readonly` (reads only; a set is recorded and reported as not applied), `emulated` (a
modelled GPU from a profile, for machines without one). Only the SM clock is controlled: HBM
parts expose one memory clock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from shared.errors import AFlexError
from shared.gpu.snap import snap_clock


class GPUError(AFlexError):
    """A GPU call failed (NVML error, unknown profile, bad clock)."""


class GPUPermissionError(GPUError):
    """Setting clocks needs root or CAP_SYS_ADMIN (compose grants it to workers)."""


class GPUNotSupportedError(GPUError):
    """The GPU or driver does not support the call."""


@dataclass(frozen=True)
class ClockResult:
    """What a clock request did: the clock asked, the supported clock it snapped to, and whether
    it was applied (False on `nvml-readonly`, or when the clock was already set)."""

    requested_mhz: int
    target_mhz: int
    applied: bool
    reason: str = ""


@dataclass(frozen=True)
class OperatorWork:
    """The work of one operator call, for the emulated backend's roofline (ignored by real GPUs)."""

    flops: float
    bytes_moved: float
    kind: str = ""  # e.g. "attention.decode", "ffn.prefill"


class GPU(ABC):
    backend: str  # "nvml", "nvml-readonly", "emulated"
    name: str  # e.g. "NVIDIA H200" or "emulated A800-SXM4-80GB"

    @abstractmethod
    def supported_sm_clocks_mhz(self) -> list[int]:
        """Supported SM clocks, ascending."""

    @abstractmethod
    def sm_clock_mhz(self) -> int:
        """The SM clock now."""

    @property
    def max_sm_clock_mhz(self) -> int:
        return self.supported_sm_clocks_mhz()[-1]

    @property
    def min_sm_clock_mhz(self) -> int:
        return self.supported_sm_clocks_mhz()[0]

    def snap_clock_mhz(self, clock_mhz: int) -> int:
        """The supported clock nearest to `clock_mhz` (clamped to the supported range)."""
        return snap_clock(self.supported_sm_clocks_mhz(), clock_mhz, "nearest")

    @abstractmethod
    def set_sm_clock_mhz(self, clock_mhz: int) -> ClockResult:
        """Lock the SM clock to the supported clock nearest `clock_mhz`."""

    @abstractmethod
    def reset_sm_clock(self) -> None:
        """Back to the driver's default clock management."""

    @abstractmethod
    def power_w(self) -> float:
        """Instant board power."""

    @abstractmethod
    def total_energy_j(self) -> float:
        """Energy since an arbitrary origin; monotonic."""

    def run(self, work: OperatorWork, measured_s: float) -> float:
        """Account one operator call that took `measured_s` on the host; returns its modelled
        duration in seconds. Real GPUs measure themselves: the measured time is the time."""
        return measured_s

    def memory_bytes(self) -> float:
        """The device's memory in bytes (0: unknown), which the global scheduler plans weights and KV into."""
        return 0.0

    def release_context(self) -> None:  # noqa: B027 - optional hook
        """The worker released its weights and context (parked cold). A real GPU's power says so itself; the
        emulated one draws bare idle from now on."""

    def create_context(self, weight_bytes: float) -> float:
        """The worker loads its weights again (a cold-parked GPU rejoins); returns the modelled seconds of the
        rejoin (a real GPU: 0, the load's wall time is the time)."""
        return 0.0

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the backend (NVML shutdown)."""

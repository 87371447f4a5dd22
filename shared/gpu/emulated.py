"""A modelled GPU for machines without one: clocks, time, power and energy from a profile.

Time per operator is a roofline per part whose compute scales with the SM clock and whose bandwidth
saturates above `f_bw_sat`; power is idle (state-dependent: with a context it follows the clock) plus
an HBM term plus CMOS dynamic power f·V(f)²; energy integrates busy and idle time on the injected
clock, and a clock request takes effect after `clock_switch_delay_ms`. The formulas and why: the
"emulated GPU's model" section of docs/gpu.md; the numbers: profiles/SOURCES.md.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from shared.gpu.base import GPU, ClockResult, GPUError, OperatorWork

PROFILES_DIR = Path(__file__).with_name("profiles")


@dataclass(frozen=True)
class GPUProfile:
    key: str
    name: str
    min_mhz: int
    max_mhz: int
    step_mhz: int
    default_mhz: int
    idle_power_w: float  # bare idle: no CUDA context (a cold-parked GPU)
    context_idle_power_w: float  # context resident, idle, at f_max
    max_power_w: float  # TDP
    memory_power_w: float
    v_min: float
    v_max: float
    knee_mhz: float
    peak_flops: float  # dense bf16, FLOP/s
    compute_efficiency: float
    bandwidth_bytes_s: float
    bandwidth_efficiency: float
    bandwidth_saturation_mhz: float
    sm_activity_memory_bound: float
    launch_overhead_s: float
    clock_switch_delay_s: float
    sources: tuple[str, ...]
    modelling_choices: tuple[str, ...]
    idle_leakage_share: float = 0.2  # of context idle at f_max, following V(f)
    idle_clock_share: float = 0.3  # of context idle at f_max, following f·V(f)² (the clock tree)
    memory_bytes: float = 80e9  # the device's memory (datasheet GB): what the planner fits weights and KV into
    host_to_device_bytes_s: float = 25e9  # weights loaded when a cold-parked GPU rejoins
    context_create_s: float = 2.0

    @property
    def clocks_mhz(self) -> list[int]:
        return list(range(self.min_mhz, self.max_mhz + 1, self.step_mhz))

    @property
    def dynamic_power_w(self) -> float:
        return self.max_power_w - self.context_idle_power_w - self.memory_power_w

    def voltage(self, clock_mhz: float) -> float:
        if clock_mhz <= self.knee_mhz:
            return self.v_min
        return self.v_min + (self.v_max - self.v_min) * (clock_mhz - self.knee_mhz) / (self.max_mhz - self.knee_mhz)

    def context_idle_power_at(self, clock_mhz: float) -> float:
        """Idle power (W) with a context resident and the SM clock at `clock_mhz`."""
        v = self.voltage(clock_mhz) / self.v_max
        floor = 1.0 - self.idle_leakage_share - self.idle_clock_share
        return self.context_idle_power_w * (floor + self.idle_leakage_share * v
                                            + self.idle_clock_share * (clock_mhz / self.max_mhz) * v * v)

    def context_idle_table(self, clocks_mhz: Iterable[float]) -> np.ndarray:
        """`context_idle_power_at` over a clock table, as an array (what the clock policy scans)."""
        return np.array([self.context_idle_power_at(float(f)) for f in clocks_mhz])

    @property
    def warm_parked_power_w(self) -> float:
        """A GPU outside the plan that keeps its context, its clock locked at the minimum."""
        return self.context_idle_power_at(self.min_mhz)

    def cold_rejoin_s(self, weight_bytes: float) -> float:
        """Time for a cold-parked GPU to serve again: its weights over the host link, plus a new context."""
        return weight_bytes / self.host_to_device_bytes_s + self.context_create_s

    def with_idle_clock_share(self, share: float) -> GPUProfile:
        """This profile with another clock-dependent idle share (the sensitivity study)."""
        if not 0.0 <= share <= 1.0 - self.idle_leakage_share:
            raise GPUError(f"idle clock share must be in [0, {1.0 - self.idle_leakage_share:.2f}], got {share}")
        out = replace(self, idle_clock_share=share)
        if out.warm_parked_power_w < self.idle_power_w:
            raise GPUError(f"idle clock share {share} puts context idle at the lowest clock "
                           f"({out.warm_parked_power_w:.1f} W) below bare idle ({self.idle_power_w:.1f} W)")
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str) -> GPUProfile:
        try:
            clk, v = d["clock_mhz"], d["voltage"]
            profile = cls(
                key=str(d["key"]), name=str(d["name"]),
                min_mhz=int(clk["min"]), max_mhz=int(clk["max"]), step_mhz=int(clk["step"]),
                default_mhz=int(clk["default"]),
                idle_power_w=float(d["idle_power_w"]), context_idle_power_w=float(d["context_idle_power_w"]),
                max_power_w=float(d["max_power_w"]), memory_power_w=float(d["memory_power_w"]),
                v_min=float(v["v_min"]), v_max=float(v["v_max"]), knee_mhz=float(v["knee_mhz"]),
                peak_flops=float(d["peak_bf16_flops"]), compute_efficiency=float(d["compute_efficiency"]),
                bandwidth_bytes_s=float(d["memory_bandwidth_bytes_s"]),
                bandwidth_efficiency=float(d["bandwidth_efficiency"]),
                bandwidth_saturation_mhz=float(d["bandwidth_saturation_mhz"]),
                sm_activity_memory_bound=float(d["sm_activity_memory_bound"]),
                launch_overhead_s=float(d["launch_overhead_s"]),
                clock_switch_delay_s=float(d["clock_switch_delay_ms"]) / 1000.0,
                sources=tuple(str(s) for s in d["sources"]),
                modelling_choices=tuple(str(s) for s in d.get("modelling_choices", ())),
                idle_leakage_share=float(d["context_idle_shares"]["leakage"]),
                idle_clock_share=float(d["context_idle_shares"]["clock"]),
                host_to_device_bytes_s=float(d["rejoin"]["host_to_device_bytes_s"]),
                context_create_s=float(d["rejoin"]["context_create_s"]),
                memory_bytes=float(d.get("memory_bytes", 80e9)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise GPUError(f"GPU profile {source} is malformed: {exc!r}") from None
        if not (0 < profile.min_mhz <= profile.default_mhz <= profile.max_mhz and profile.step_mhz > 0):
            raise GPUError(f"GPU profile {source}: bad clock range {clk}")
        if profile.dynamic_power_w <= 0 or not profile.sources:
            raise GPUError(f"GPU profile {source}: needs max_power_w > idle + memory power, and sources")
        shares = (profile.idle_leakage_share, profile.idle_clock_share)
        if min(shares) < 0 or sum(shares) > 1:
            raise GPUError(f"GPU profile {source}: context_idle_shares must be >= 0 and sum to <= 1, got {shares}")
        if not 0 < profile.idle_power_w <= profile.warm_parked_power_w:
            raise GPUError(f"GPU profile {source}: bare idle {profile.idle_power_w} W must be > 0 and at most the "
                           f"context idle at the lowest clock ({profile.warm_parked_power_w:.1f} W)")
        return profile


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


@cache
def _load_path(path: Path) -> GPUProfile:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise GPUError(f"cannot read GPU profile {path}: {exc}") from None
    return GPUProfile.from_dict(data, str(path))


def load_profile(name: str | Path) -> GPUProfile:
    """A profile by key ("a800") or by path to a JSON file."""
    path = Path(name)
    if path.suffix != ".json":
        path = PROFILES_DIR / f"{str(name).lower()}.json"
        if not path.is_file():
            raise GPUError(f"unknown GPU profile {name!r}; available: {', '.join(available_profiles())}")
    return _load_path(path.resolve())


def _parts(work: OperatorWork) -> Sequence[OperatorWork]:
    parts: Sequence[OperatorWork] = getattr(work, "parts", ())
    return parts or (work,)


@dataclass(frozen=True)
class Cost:
    """Modelled duration and mean busy power of one operator at one clock."""

    time_s: float
    power_w: float

    @property
    def energy_j(self) -> float:
        return self.time_s * self.power_w


def operator_cost(profile: GPUProfile, work: OperatorWork, clock_mhz: float) -> Cost:
    """Time and mean power of `work` at `clock_mhz` (pure: no state, no clock)."""
    p = profile
    ratio = clock_mhz / p.max_mhz
    flops_s = p.peak_flops * p.compute_efficiency * ratio
    bw_full = p.bandwidth_bytes_s * p.bandwidth_efficiency
    bw = bw_full * min(1.0, clock_mhz / p.bandwidth_saturation_mhz)
    dyn = p.dynamic_power_w * ratio * (p.voltage(clock_mhz) / p.v_max) ** 2
    idle_w = p.context_idle_power_at(clock_mhz)
    total_t = energy = 0.0
    for part in _parts(work):
        t_c, t_m = part.flops / flops_s, part.bytes_moved / bw
        busy = max(t_c, t_m)
        t = busy + p.launch_overhead_s
        if busy > 0:
            u_mem = part.bytes_moved / bw_full / busy  # HBM power follows the bytes per second moved
            u_sm = min(1.0, (t_c + p.sm_activity_memory_bound * t_m) / busy)
            energy += busy * (idle_w + p.memory_power_w * u_mem + u_sm * dyn)
        energy += p.launch_overhead_s * idle_w
        total_t += t
    return Cost(total_t, energy / total_t if total_t > 0 else idle_w)


class EmulatedGPU(GPU):
    """A GPU modelled from a profile; energy accounting follows the injected clock."""

    backend = "emulated"

    def __init__(
        self,
        profile: str | Path | GPUProfile = "a800",
        pace: bool = False,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        context_resident: bool = True,
        device_file: Path | None = None,
    ) -> None:
        self.profile = profile if isinstance(profile, GPUProfile) else load_profile(profile)
        # Where the device keeps its locked clock, as a driver does: it outlives the process that set
        # it (a worker killed at a low clock leaves the next one a slow GPU until someone resets it).
        self.device_file = device_file
        self.name = f"emulated {self.profile.name}"
        self.pace = pace
        self._clock = clock
        self._sleep = sleep
        self.context_resident = context_resident
        self._clocks = self.profile.clocks_mhz
        self._current_mhz = self.locked_mhz() or self.profile.default_mhz
        self._pending: tuple[float, int] | None = None  # (time it takes effect, clock)
        self._before_switch: tuple[float, int] | None = None  # (time of the last switch, clock before it)
        now = clock()
        self._energy_j = 0.0
        self._busy_until = now  # end of the last modelled operator (may run ahead of the wall clock)
        self._accounted_until = now  # energy is accounted up to here (busy or idle)
        self._busy_power_w = self.idle_power_w
        # the books are kept from several threads (an FFN worker runs its forwards on its serving threads while
        # its telemetry and heartbeats read the total on the event loop): one at a time, or a stretch is counted
        # twice (idle and busy) or not at all
        self._books = threading.RLock()

    # -- clocks -------------------------------------------------------------------------------
    @property
    def idle_power_w(self) -> float:
        """Idle power now: context-resident at the clock in effect, or bare idle without a context."""
        return self._idle_at(self.sm_clock_mhz())

    def _idle_at(self, clock_mhz: int) -> float:
        return self.profile.context_idle_power_at(clock_mhz) if self.context_resident else self.profile.idle_power_w

    def supported_sm_clocks_mhz(self) -> list[int]:
        return list(self._clocks)

    def _settle(self, now: float) -> None:
        if self._pending is not None and now >= self._pending[0]:
            self._before_switch = (self._pending[0], self._current_mhz)
            self._current_mhz = self._pending[1]
            self._pending = None

    def sm_clock_mhz(self) -> int:
        self._settle(self._clock())
        return self._current_mhz

    def set_sm_clock_mhz(self, clock_mhz: int) -> ClockResult:
        target = self.snap_clock_mhz(clock_mhz)
        with self._books:
            now = self._clock()
            self._settle(now)
            wanted = self._pending[1] if self._pending is not None else self._current_mhz
            if target == wanted:
                return ClockResult(clock_mhz, target, applied=False, reason=f"already at {target} MHz")
            self._pending = (now + self.profile.clock_switch_delay_s, target)
        self._write_lock(target)
        return ClockResult(clock_mhz, target, applied=True)

    def reset_sm_clock(self) -> None:
        self.set_sm_clock_mhz(self.profile.default_mhz)
        self._write_lock(None)

    def locked_mhz(self) -> int | None:
        """The clock the device is locked at (None: the driver's own), as its device file holds it."""
        return read_locked_mhz(self.device_file) if self.device_file is not None else None

    def _write_lock(self, clock_mhz: int | None) -> None:
        if self.device_file is not None:
            write_locked_mhz(self.device_file, clock_mhz)

    # -- model --------------------------------------------------------------------------------
    def cost(self, work: OperatorWork, clock_mhz: int | None = None) -> Cost:
        """Modelled time and power of `work` at `clock_mhz` (default: the clock now)."""
        return operator_cost(self.profile, work, self.sm_clock_mhz() if clock_mhz is None else clock_mhz)

    # -- accounting ---------------------------------------------------------------------------
    def _account_idle(self, until: float) -> None:
        """Idle energy up to `until` at the clock in effect: the last switch inside the stretch splits it."""
        start = self._accounted_until
        if until <= start:
            return
        self._settle(until)
        if self._before_switch is not None and start < self._before_switch[0] < until:
            switch_at, old_mhz = self._before_switch
            self._energy_j += (switch_at - start) * self._idle_at(old_mhz)
            start = switch_at
        self._energy_j += (until - start) * self._idle_at(self._current_mhz)
        self._accounted_until = until

    def run(self, work: OperatorWork, measured_s: float) -> float:
        """Account `work` that just took `measured_s` on the host; returns its modelled duration.

        The operator starts at (now − measured_s), or where the accounting already reached if that
        is later (the previous operator's modelled end), and runs for its modelled duration at the
        clock in effect then. With `pace`, sleep the part of the modelled duration the host did
        not already spend, so a lower clock really slows the caller."""
        with self._books:
            now = self._clock()
            start = max(now - measured_s, self._accounted_until)
            self._account_idle(start)
            self._settle(start)
            cost = operator_cost(self.profile, work, self._current_mhz)
            self._energy_j += cost.energy_j
            self._accounted_until = self._busy_until = start + cost.time_s
            self._busy_power_w = cost.power_w
        if self.pace and cost.time_s > measured_s:
            self._sleep(cost.time_s - measured_s)
        return cost.time_s

    def release_context(self) -> None:
        """Parked cold: the idle up to now at the context's power, bare idle (`profile.idle_power_w`) after."""
        with self._books:
            self._account_idle(self._clock())
            self.context_resident = False

    def create_context(self, weight_bytes: float) -> float:
        """A cold-parked GPU rejoins: a new context and `weight_bytes` over the host link
        (`profile.cold_rejoin_s`), drawing context-idle power meanwhile, as the simulator's fleet charges a
        rejoining GPU. Returns the modelled seconds (slept with `pace` where the host was quicker)."""
        with self._books:
            if self.context_resident:
                return 0.0
            now = self._clock()
            start = max(now, self._accounted_until)
            self._account_idle(start)
            self.context_resident = True
            rejoin_s = self.profile.cold_rejoin_s(weight_bytes)
            self._energy_j += rejoin_s * self.profile.context_idle_power_w
            self._accounted_until = self._busy_until = start + rejoin_s
            self._busy_power_w = self.profile.context_idle_power_w
        if self.pace:
            self._sleep(rejoin_s)
        return rejoin_s

    def memory_bytes(self) -> float:
        return self.profile.memory_bytes

    def power_w(self) -> float:
        now = self._clock()
        return self._busy_power_w if now < self._busy_until else self.idle_power_w

    def total_energy_j(self) -> float:
        with self._books:
            self._account_idle(self._clock())
            return self._energy_j


def read_locked_mhz(device_file: Path) -> int | None:
    try:
        value = json.loads(device_file.read_text()).get("locked_mhz")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) else None


def write_locked_mhz(device_file: Path, clock_mhz: int | None) -> None:
    """Atomically (a reader never sees half a file); None unlocks."""
    device_file.parent.mkdir(parents=True, exist_ok=True)
    partial = device_file.with_name(f".{device_file.name}.{os.getpid()}")
    partial.write_text(json.dumps({"locked_mhz": clock_mhz}))
    os.replace(partial, device_file)

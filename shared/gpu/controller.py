"""The worker's local DVFS controller: per-phase clocks from the scheduler, applied with hysteresis.

The scheduler commands one SM clock per phase, valid until a deadline; the worker asks for its clock
before each microbatch's work (`before_microbatch(phase)`) and the controller decides whether to
switch: clamped and snapped, the default clock once a command expires (a dead scheduler never leaves
a GPU slow), and no switch within `hysteresis_mhz` or `min_hold_s` (no flapping between interleaved
phases). Pure logic with an injectable clock; the rules in full: docs/gpu.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from shared.gpu.base import GPU, ClockResult, GPUError
from shared.gpu.snap import snap_clock
from shared.messages import FrequencyCommand

log = logging.getLogger("aflex.gpu.controller")



class DVFSController:
    """Per-phase SM clocks from the scheduler's commands, applied through `gpu` with hysteresis."""

    def __init__(self, gpu: GPU, *, default_clock_mhz: int | None = None, hysteresis_mhz: int = 30,
                 min_hold_s: float = 0.2, clock: Callable[[], float] = time.time) -> None:
        self.gpu = gpu
        self.clocks_mhz = sorted(gpu.supported_sm_clocks_mhz())
        if not self.clocks_mhz:
            raise GPUError(f"GPU {gpu.name} reports no supported SM clocks")
        wanted = default_clock_mhz if default_clock_mhz is not None else self.clocks_mhz[-1]
        self.default_clock_mhz = snap_clock(self.clocks_mhz, wanted, "nearest")
        self.hysteresis_mhz = max(0, int(hysteresis_mhz))
        self.min_hold_s = max(0.0, float(min_hold_s))
        self._now = clock
        self.phase_clocks_mhz: dict[str, int] = {}  # the valid command's clocks, snapped
        self.valid_until_ts = 0.0
        self.issued_ts = float("-inf")
        self.last_phase = "decode"  # an idle worker follows the decode clock (poll)
        self.target_clock_mhz: int | None = None  # the clock last asked of the GPU
        self.applied = True  # whether the last set took effect (False on nvml-readonly)
        self.last_result: ClockResult | None = None
        self.switches = 0  # sets made (including the first)
        self.commands = 0  # commands accepted
        self._last_switch = float("-inf")
        self._warned = False

    # -- commands -------------------------------------------------------------------------------

    def apply_command(self, cmd: FrequencyCommand) -> dict[str, int]:
        """Store the command's per-phase clocks (clamped and snapped); returns them.

        A command issued before the one held is ignored (messages may cross), and so is its return.
        """
        if cmd.issued_ts < self.issued_ts:
            log.debug("ignored a frequency command issued before the current one")
            return dict(self.phase_clocks_mhz)
        self.phase_clocks_mhz = {phase: snap_clock(self.clocks_mhz, int(mhz), "nearest")
                                 for phase, mhz in cmd.clocks_mhz.items()}
        self.valid_until_ts = cmd.valid_until_ts
        self.issued_ts = cmd.issued_ts
        self.commands += 1
        return dict(self.phase_clocks_mhz)

    # -- the hot path ---------------------------------------------------------------------------

    def before_microbatch(self, phase: str) -> int:
        """Called before computing work of `phase` ("prefill" or "decode"); returns the target clock."""
        self.last_phase = phase
        now = self._now()
        want = self.phase_clocks_mhz.get(phase, self.default_clock_mhz) if now < self.valid_until_ts \
            else self.default_clock_mhz
        target = self.target_clock_mhz
        if target is None:
            return self._switch(want, now)
        if want != target and abs(want - target) > self.hysteresis_mhz and now - self._last_switch >= self.min_hold_s:
            return self._switch(want, now)
        return target

    def poll(self) -> int:
        """The periodic check (telemetry loop): follows a new command or an expiry while idle."""
        return self.before_microbatch(self.last_phase)

    def _switch(self, clock_mhz: int, now: float) -> int:
        self.target_clock_mhz = clock_mhz
        self._last_switch = now
        self.switches += 1
        try:
            result = self.gpu.set_sm_clock_mhz(clock_mhz)
        except GPUError as exc:  # no permission, not supported: keep serving, report not applied
            if not self._warned:
                log.warning("cannot set the SM clock of %s to %d MHz: %s", self.gpu.name, clock_mhz, exc)
                self._warned = True
            self.applied, self.last_result = False, ClockResult(clock_mhz, clock_mhz, False, str(exc))
            return clock_mhz
        self.last_result = result
        # "not applied because already set" still means the GPU runs the target clock
        self.applied = result.applied or (self.gpu.backend != "nvml-readonly"
                                          and not result.reason.startswith("readonly")
                                          and self.gpu.sm_clock_mhz() == result.target_mhz)
        if not self.applied and not self._warned:
            log.warning("SM clock %d MHz on %s recorded, not applied: %s", clock_mhz, self.gpu.name,
                        result.reason or self.gpu.backend)
            self._warned = True
        return clock_mhz

    # -- exit -----------------------------------------------------------------------------------

    def reset(self) -> None:
        """Give the clock back to the driver (on exit); the next check sets a clock again."""
        try:
            self.gpu.reset_sm_clock()
        except GPUError as exc:
            log.warning("could not reset the SM clock of %s: %s", self.gpu.name, exc)
        self.target_clock_mhz = None
        self._last_switch = float("-inf")

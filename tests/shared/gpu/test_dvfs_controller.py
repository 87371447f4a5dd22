"""The local DVFS controller: clamping and snapping, phase clocks, expiry, hysteresis, hold, reset."""

from __future__ import annotations

import pytest

from shared.gpu.base import GPU, ClockResult, GPUPermissionError
from shared.gpu.controller import DVFSController
from shared.gpu.snap import snap_clock
from shared.messages import FrequencyCommand

CLOCKS = list(range(210, 1411, 15))  # A800: 210..1410 MHz in 15 MHz steps


class FakeGPU(GPU):
    """Records every set; `readonly` records without applying; `deny` raises like NVML without root."""

    def __init__(self, backend: str = "emulated", deny: bool = False) -> None:
        self.backend, self.name = backend, f"fake {backend}"
        self.deny = deny
        self.clock = 1410
        self.sets: list[int] = []
        self.resets = 0

    def supported_sm_clocks_mhz(self) -> list[int]:
        return list(CLOCKS)

    def sm_clock_mhz(self) -> int:
        return self.clock

    def set_sm_clock_mhz(self, clock_mhz: int) -> ClockResult:
        if self.deny:
            raise GPUPermissionError("no permission")
        target = self.snap_clock_mhz(clock_mhz)
        self.sets.append(target)
        if self.backend == "nvml-readonly":
            return ClockResult(clock_mhz, target, applied=False, reason="readonly backend")
        applied = target != self.clock
        self.clock = target
        return ClockResult(clock_mhz, target, applied=applied)

    def reset_sm_clock(self) -> None:
        self.resets += 1
        if self.backend != "nvml-readonly":
            self.clock = 1410

    def power_w(self) -> float:
        return 100.0

    def total_energy_j(self) -> float:
        return 0.0


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def command(clocks: dict[str, int], valid_s: float, now: float, issued: float | None = None) -> FrequencyCommand:
    return FrequencyCommand(worker_id="w", clocks_mhz=clocks, valid_until_ts=now + valid_s,  # type: ignore[arg-type]
                            issued_ts=now if issued is None else issued)


def make(gpu: GPU | None = None, **kw: object) -> tuple[DVFSController, FakeGPU, FakeClock]:
    fake = gpu if isinstance(gpu, FakeGPU) else FakeGPU()
    clock = FakeClock()
    args: dict = {"default_clock_mhz": None, "hysteresis_mhz": 30, "min_hold_s": 0.2, **kw}
    return DVFSController(fake, clock=clock, **args), fake, clock


def test_snap_clamps_and_picks_nearest() -> None:
    assert snap_clock(CLOCKS, 0, "nearest") == 210 and snap_clock(CLOCKS, 5000, "nearest") == 1410
    assert [snap_clock(CLOCKS, f, "nearest") for f in (600, 607, 608)] == [600, 600, 615]
    assert snap_clock(CLOCKS, 607.5, "nearest") == 600  # ties go down
    with pytest.raises(ValueError, match="rounding"):
        snap_clock(CLOCKS, 600, "sideways")  # type: ignore[arg-type]


def test_command_is_clamped_and_snapped() -> None:
    ctl, gpu, clock = make()
    got = ctl.apply_command(command({"prefill": 9999, "decode": 453}, 10, clock.t))
    assert got == {"prefill": 1410, "decode": 450}
    assert ctl.before_microbatch("decode") == 450 and gpu.clock == 450
    ctl2, _, clock2 = make()
    assert ctl2.apply_command(command({"decode": 10}, 10, clock2.t)) == {"decode": 210}


def test_default_clock_is_max_or_configured_snapped() -> None:
    ctl, gpu, _ = make()
    assert ctl.default_clock_mhz == 1410
    assert ctl.before_microbatch("prefill") == 1410 and ctl.switches == 1 and ctl.applied  # first set always
    ctl, gpu, _ = make(default_clock_mhz=1003)
    assert ctl.default_clock_mhz == 1005 and ctl.poll() == 1005 and gpu.clock == 1005


def test_phase_switching_follows_the_command() -> None:
    ctl, gpu, clock = make(min_hold_s=0.0)
    ctl.apply_command(command({"prefill": 660, "decode": 450}, 60, clock.t))
    assert ctl.before_microbatch("prefill") == 660 and gpu.clock == 660
    clock.t += 0.01
    assert ctl.before_microbatch("decode") == 450 and gpu.clock == 450
    clock.t += 0.01
    assert ctl.before_microbatch("prefill") == 660
    assert gpu.sets == [660, 450, 660] and ctl.switches == 3
    # same phase again: no GPU call at all
    assert ctl.before_microbatch("prefill") == 660 and gpu.sets == [660, 450, 660]
    # a phase the command leaves out runs the default
    ctl.apply_command(command({"decode": 450}, 60, clock.t + 1, issued=clock.t + 1))
    clock.t += 0.01
    assert ctl.before_microbatch("prefill") == 1410


def test_expired_command_falls_back_to_default() -> None:
    ctl, gpu, clock = make(default_clock_mhz=1200)
    ctl.apply_command(command({"prefill": 600, "decode": 600}, 2.0, clock.t))
    assert ctl.before_microbatch("decode") == 600 and gpu.clock == 600  # the command holds
    clock.t += 1.9
    assert ctl.before_microbatch("decode") == 600
    clock.t += 0.1  # valid_until reached: the command no longer holds
    assert ctl.poll() == 1200 and gpu.clock == 1200  # an idle worker falls back too (telemetry loop polls)
    clock.t += 1.0
    assert ctl.before_microbatch("prefill") == 1200  # for every phase the command named


def test_stale_command_is_ignored() -> None:
    ctl, _, clock = make()
    ctl.apply_command(command({"decode": 600}, 10, clock.t, issued=clock.t))
    ctl.apply_command(command({"decode": 900}, 10, clock.t, issued=clock.t - 1))  # crossed on the way
    assert ctl.before_microbatch("decode") == 600 and ctl.commands == 1


def test_hysteresis_band_keeps_the_clock() -> None:
    ctl, gpu, clock = make(hysteresis_mhz=30, min_hold_s=0.0)
    ctl.apply_command(command({"prefill": 630, "decode": 600}, 60, clock.t))
    ctl.before_microbatch("decode")
    for _ in range(5):
        clock.t += 1
        assert ctl.before_microbatch("prefill") == 600  # 30 MHz away: within the band
        assert ctl.before_microbatch("decode") == 600
    assert gpu.sets == [600] and ctl.switches == 1
    ctl.apply_command(command({"prefill": 645, "decode": 600}, 60, clock.t, issued=clock.t))
    assert ctl.before_microbatch("prefill") == 645  # 45 MHz: outside the band


def test_hold_time_prevents_flapping() -> None:
    ctl, gpu, clock = make(hysteresis_mhz=30, min_hold_s=0.2)
    ctl.apply_command(command({"prefill": 1200, "decode": 500}, 60, clock.t))
    assert ctl.before_microbatch("prefill") == 1200
    # interleaved microbatches every 50 ms: at most one switch per 200 ms
    phases = ["decode", "prefill"] * 10
    for phase in phases:
        clock.t += 0.05
        ctl.before_microbatch(phase)
    assert ctl.switches <= 1 + (0.05 * len(phases)) / 0.2 + 1e-9
    assert len(gpu.sets) == ctl.switches
    # a deferred switch happens at the first check after the hold
    ctl2, gpu2, clock2 = make(min_hold_s=0.2)
    ctl2.apply_command(command({"prefill": 1200, "decode": 510}, 60, clock2.t))
    ctl2.before_microbatch("prefill")
    clock2.t += 0.1
    assert ctl2.before_microbatch("decode") == 1200  # held
    clock2.t += 0.11
    assert ctl2.before_microbatch("decode") == 510 and gpu2.clock == 510


def test_reset_on_exit_and_next_set_is_made() -> None:
    ctl, gpu, clock = make()
    ctl.apply_command(command({"decode": 450}, 60, clock.t))
    ctl.before_microbatch("decode")
    ctl.reset()
    assert gpu.resets == 1 and gpu.clock == 1410 and ctl.target_clock_mhz is None
    assert ctl.before_microbatch("decode") == 450 and gpu.clock == 450  # no hold after a reset


def test_readonly_records_not_applied() -> None:
    ctl, gpu, clock = make(FakeGPU("nvml-readonly"))
    ctl.apply_command(command({"decode": 450}, 60, clock.t))
    assert ctl.before_microbatch("decode") == 450
    assert ctl.target_clock_mhz == 450 and not ctl.applied and gpu.clock == 1410
    ctl.reset()
    assert gpu.resets == 1


def test_permission_error_is_not_fatal() -> None:
    ctl, _, clock = make(FakeGPU(deny=True))
    ctl.apply_command(command({"decode": 450}, 60, clock.t))
    assert ctl.before_microbatch("decode") == 450 and not ctl.applied
    assert ctl.last_result is not None and "permission" in ctl.last_result.reason


def test_already_at_clock_counts_as_applied() -> None:
    ctl, gpu, _ = make()
    assert gpu.clock == 1410
    ctl.poll()  # the fake says applied=False (already there), yet the GPU runs the target
    assert ctl.applied and ctl.target_clock_mhz == 1410


@pytest.mark.parametrize("profile", ["a800", "h200"])
def test_with_the_emulated_gpu(profile: str) -> None:
    from shared.gpu.emulated import EmulatedGPU

    t = [0.0]
    gpu = EmulatedGPU(profile, clock=lambda: t[0])
    ctl = DVFSController(gpu, default_clock_mhz=None, hysteresis_mhz=30, min_hold_s=0.2, clock=lambda: t[0])
    ctl.apply_command(FrequencyCommand(worker_id="w", clocks_mhz={"decode": 600}, valid_until_ts=5.0, issued_ts=0.0))
    assert ctl.before_microbatch("decode") == 600 and ctl.applied
    t[0] = 1.0
    assert gpu.sm_clock_mhz() == 600
    t[0] = 6.0
    assert ctl.poll() == gpu.max_sm_clock_mhz
    ctl.before_microbatch("decode")
    ctl.reset()
    t[0] = 7.0
    assert gpu.sm_clock_mhz() == gpu.max_sm_clock_mhz

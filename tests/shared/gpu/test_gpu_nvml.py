"""NvmlGPU against a fake `pynvml` that records every call: no GPU needed."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from shared.gpu.base import GPUError, GPUNotSupportedError, GPUPermissionError
from shared.gpu.controller import DVFSController
from shared.gpu.nvml import NvmlGPU
from shared.gpu.select import select_gpu

SETTERS = {"nvmlDeviceSetGpuLockedClocks", "nvmlDeviceResetGpuLockedClocks", "nvmlDeviceSetApplicationsClocks",
           "nvmlDeviceSetMemoryLockedClocks", "nvmlDeviceSetPowerManagementLimit"}


class FakeNvml(types.ModuleType):
    NVML_SUCCESS = 0
    NVML_ERROR_UNINITIALIZED = 1
    NVML_ERROR_INVALID_ARGUMENT = 2
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_NO_PERMISSION = 4
    NVML_ERROR_LIBRARY_NOT_FOUND = 12
    NVML_ERROR_UNKNOWN = 999
    NVML_CLOCK_GRAPHICS = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(value)
            self.value = value

        def __str__(self) -> str:
            return {3: "Not Supported", 4: "Insufficient Permissions", 12: "NVML Shared Library Not Found"}.get(
                self.value, "Unknown Error")

    def __init__(self, n_devices: int = 4) -> None:
        super().__init__("pynvml")
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.fail: dict[str, int] = {}  # function name -> NVML error code
        self.n_devices = n_devices
        self.sm_clock = 1410
        self.power_mw = 250_000
        self.energy_mj = 123_456_789
        self.graphics = list(range(1410, 209, -15))  # nvidia-smi order: high to low
        fake = self

        def record(name: str, result: Any = None):
            def fn(*args: Any) -> Any:
                fake.calls.append((name, args))
                if name in fake.fail:
                    raise FakeNvml.NVMLError(fake.fail[name])
                return result(*args) if callable(result) else result
            return fn

        for name, result in {
            "nvmlInit": None, "nvmlShutdown": None, "_nvmlGetFunctionPointer": None,
            "nvmlDeviceGetCount": lambda: fake.n_devices,
            "nvmlDeviceGetHandleByIndex": lambda i: f"handle{i}",
            "nvmlDeviceGetHandleByUUID": lambda u: f"handle-{u}",
            "nvmlDeviceGetName": lambda h: "NVIDIA A800-SXM4-80GB",
            "nvmlDeviceGetSupportedMemoryClocks": lambda h: [1593, 810],
            "nvmlDeviceGetSupportedGraphicsClocks": lambda h, m: list(fake.graphics) if m == 1593 else [210],
            "nvmlDeviceGetClockInfo": lambda h, t: fake.sm_clock if t == FakeNvml.NVML_CLOCK_SM else 1593,
            "nvmlDeviceSetGpuLockedClocks": None, "nvmlDeviceResetGpuLockedClocks": None,
            "nvmlDeviceGetPowerUsage": lambda h: fake.power_mw,
            "nvmlDeviceGetTotalEnergyConsumption": lambda h: fake.energy_mj,
            "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(total=85_899_345_920, free=1, used=2),
        }.items():
            setattr(self, name, record(name, result))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake


def test_init_reads_clocks_at_max_memory_clock_sorted(nvml: FakeNvml) -> None:
    gpu = NvmlGPU()
    assert gpu.backend == "nvml" and gpu.name == "NVIDIA A800-SXM4-80GB"
    assert ("nvmlDeviceGetSupportedGraphicsClocks", ("handle0", 1593)) in nvml.calls
    clocks = gpu.supported_sm_clocks_mhz()
    assert clocks == sorted(clocks) and clocks[0] == 210 and clocks[-1] == 1410 and len(clocks) == 81
    assert nvml.names()[0] == "nvmlInit"


def test_set_locks_min_equal_max_after_snapping(nvml: FakeNvml) -> None:
    gpu = NvmlGPU()
    result = gpu.set_sm_clock_mhz(1000)
    assert result.applied and result.requested_mhz == 1000 and result.target_mhz == 1005
    assert nvml.calls[-1] == ("nvmlDeviceSetGpuLockedClocks", ("handle0", 1005, 1005))
    again = gpu.set_sm_clock_mhz(1005)  # de-duplicated: no second NVML write
    assert not again.applied and nvml.names().count("nvmlDeviceSetGpuLockedClocks") == 1
    assert gpu.set_sm_clock_mhz(5000).target_mhz == 1410 and gpu.set_sm_clock_mhz(1).target_mhz == 210
    gpu.reset_sm_clock()
    assert nvml.calls[-1] == ("nvmlDeviceResetGpuLockedClocks", ("handle0",))


def test_reads_clock_power_energy_in_the_right_units(nvml: FakeNvml) -> None:
    gpu = NvmlGPU()
    nvml.sm_clock = 1095
    assert gpu.sm_clock_mhz() == 1095
    assert nvml.calls[-1] == ("nvmlDeviceGetClockInfo", ("handle0", FakeNvml.NVML_CLOCK_SM))
    assert gpu.power_w() == pytest.approx(250.0)  # mW -> W
    assert gpu.total_energy_j() == pytest.approx(123_456.789)  # mJ -> J
    assert nvml.calls[-1] == ("nvmlDeviceGetTotalEnergyConsumption", ("handle0",))
    gpu.close()
    gpu.close()
    assert nvml.names().count("nvmlShutdown") == 1


def test_reports_the_devices_memory_or_zero_when_nvml_will_not(nvml: FakeNvml) -> None:
    gpu = NvmlGPU()
    assert gpu.memory_bytes() == 85_899_345_920  # an 80 GB card's total, as NVML reports it
    nvml.fail["nvmlDeviceGetMemoryInfo"] = FakeNvml.NVML_ERROR_NOT_SUPPORTED
    assert gpu.memory_bytes() == 0.0  # unknown: the planner takes the profile's
    gpu.close()


def test_energy_falls_back_to_integrating_power(nvml: FakeNvml) -> None:
    nvml.fail["nvmlDeviceGetTotalEnergyConsumption"] = FakeNvml.NVML_ERROR_NOT_SUPPORTED
    now = [0.0]
    gpu = NvmlGPU(clock=lambda: now[0])
    assert gpu.total_energy_j() == 0.0
    now[0] = 2.0
    nvml.power_mw = 350_000
    assert gpu.total_energy_j() == pytest.approx(2.0 * (250 + 350) / 2)
    now[0] = 3.0
    assert gpu.total_energy_j() == pytest.approx(600.0 + 350.0)
    assert nvml.names().count("nvmlDeviceGetTotalEnergyConsumption") == 1  # probed once


def test_readonly_never_calls_a_setter(nvml: FakeNvml) -> None:
    gpu = NvmlGPU(readonly=True)
    assert gpu.backend == "nvml-readonly"
    result = gpu.set_sm_clock_mhz(600)
    assert not result.applied and result.target_mhz == 600
    assert result.reason == "nvml-readonly: clocks are never set"
    controller = DVFSController(gpu, default_clock_mhz=600)  # the worker's path: asked for, recorded, not applied
    assert controller.poll() == 600 and controller.target_clock_mhz == 600 and not controller.applied
    gpu.reset_sm_clock()
    gpu.sm_clock_mhz(), gpu.power_w(), gpu.total_energy_j()
    assert not SETTERS & set(nvml.names())


@pytest.mark.parametrize(("env", "index", "expected"), [
    (None, None, ("nvmlDeviceGetHandleByIndex", (0,))),
    (None, 2, ("nvmlDeviceGetHandleByIndex", (2,))),
    ("3,1", None, ("nvmlDeviceGetHandleByIndex", (3,))),
    ("3,1", 1, ("nvmlDeviceGetHandleByIndex", (1,))),
    ("GPU-abc,2", 0, ("nvmlDeviceGetHandleByUUID", ("GPU-abc",))),
    ("2,-1,0", 0, ("nvmlDeviceGetHandleByIndex", (2,))),
])
def test_cuda_visible_devices_maps_to_nvml(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch, env: str | None,
                                           index: int | None, expected: tuple[str, tuple[Any, ...]]) -> None:
    if env is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    NvmlGPU(index)
    assert [c for c in nvml.calls if c[0].startswith("nvmlDeviceGetHandleBy")] == [expected]


@pytest.mark.parametrize(("env", "index"), [("", None), ("MIG-1234", None), ("0,1", 2), ("2,-1,0", 1), (None, 4)])
def test_bad_device_selection_is_a_typed_error(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch, env: str | None,
                                               index: int | None) -> None:
    if env is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    with pytest.raises(GPUError):
        NvmlGPU(index)
    assert nvml.names().count("nvmlShutdown") == 1  # init is undone


def test_no_permission_says_what_is_needed(nvml: FakeNvml) -> None:
    nvml.fail["nvmlDeviceSetGpuLockedClocks"] = FakeNvml.NVML_ERROR_NO_PERMISSION
    gpu = NvmlGPU()
    with pytest.raises(GPUPermissionError) as info:
        gpu.set_sm_clock_mhz(900)
    message = str(info.value)
    assert "root" in message and "CAP_SYS_ADMIN" in message and "cap_add: [SYS_ADMIN]" in message
    assert "nvmlDeviceSetGpuLockedClocks" in message
    assert isinstance(info.value.__cause__, FakeNvml.NVMLError)


def test_not_supported_and_other_errors(nvml: FakeNvml) -> None:
    nvml.fail["nvmlDeviceResetGpuLockedClocks"] = FakeNvml.NVML_ERROR_NOT_SUPPORTED
    nvml.fail["nvmlDeviceGetPowerUsage"] = FakeNvml.NVML_ERROR_UNKNOWN
    gpu = NvmlGPU()
    with pytest.raises(GPUNotSupportedError):
        gpu.reset_sm_clock()
    with pytest.raises(GPUError, match="nvmlDeviceGetPowerUsage") as info:
        gpu.power_w()
    assert type(info.value) is GPUError


def test_missing_library_and_unofficial_package(nvml: FakeNvml) -> None:
    nvml.fail["nvmlInit"] = FakeNvml.NVML_ERROR_LIBRARY_NOT_FOUND
    with pytest.raises(GPUError, match="nvmlInit"):
        NvmlGPU()
    del nvml.fail["nvmlInit"]
    delattr(nvml, "_nvmlGetFunctionPointer")
    with pytest.raises(GPUError, match="nvidia-ml-py"):
        NvmlGPU()


def test_select_gpu(nvml: FakeNvml) -> None:
    auto = select_gpu("auto")
    assert auto.backend == "nvml-readonly"
    assert not auto.set_sm_clock_mhz(600).applied and not SETTERS & set(nvml.names())
    assert select_gpu("nvml").backend == "nvml"
    assert select_gpu("emulated", profile="h100").backend == "emulated"
    nvml.fail["nvmlInit"] = FakeNvml.NVML_ERROR_LIBRARY_NOT_FOUND
    fallback = select_gpu("auto", profile="h200")
    assert fallback.backend == "emulated" and "H200" in fallback.name
    for backend in ("nvml", "nvml-readonly"):
        with pytest.raises(GPUError, match="unavailable"):
            select_gpu(backend)
    with pytest.raises(GPUError, match="unknown GPU backend"):
        select_gpu("cuda")

"""`aflex up` and GPUs: one GPU per worker where the host has enough, flags passed on, and the clock
of a dead worker that was setting clocks reset (against a fake `pynvml` that records its calls)."""

from __future__ import annotations

import argparse

import pytest

from services.launcher.cli import build_parser
from services.launcher.supervisor import ChildExit, add_up_arguments, build_commands
from services.launcher.worker_gpus import reset_clock_hook
from tests.shared.gpu.test_gpu_nvml import FakeNvml, nvml  # noqa: F401 - the fixture


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_up_arguments(parser)
    return parser.parse_args(list(argv))


def test_each_worker_gets_its_own_gpu_and_the_flags(nvml: FakeNvml) -> None:  # noqa: F811
    specs = build_commands(_args("--attention-workers", "2", "--ffn-workers", "2", "--gpu-control", "nvml"))
    workers = [s for s in specs if s.role in ("attention-worker", "ffn-worker")]
    assert [s.env.get("CUDA_VISIBLE_DEVICES") for s in workers] == ["0", "1", "2", "3"]
    for spec in workers:
        assert spec.env["AFLEX_GPU_BACKEND"] == "nvml"
        build_parser().parse_args(spec.argv[3:])  # every command parses with the real CLI


def test_too_few_gpus_pins_nothing(nvml: FakeNvml) -> None:  # noqa: F811
    nvml.n_devices = 1
    specs = build_commands(_args("--attention-workers", "1", "--ffn-workers", "1"))
    assert all("CUDA_VISIBLE_DEVICES" not in s.env for s in specs)


def test_emulated_workers_are_not_pinned(nvml: FakeNvml) -> None:  # noqa: F811
    specs = build_commands(_args("--gpu-control", "emulated", "--gpu-profile", "h200", "--gpu-pace"))
    worker = next(s for s in specs if s.role == "attention-worker")
    assert "CUDA_VISIBLE_DEVICES" not in worker.env
    assert (worker.env["AFLEX_GPU_BACKEND"], worker.env["AFLEX_GPU_PROFILE"]) == ("emulated", "h200")
    assert worker.env["AFLEX_GPU_PACE"] == "true"


@pytest.mark.parametrize(("control", "resets"), [("nvml", True), ("nvml-readonly", False), ("emulated", False)])
def test_dead_worker_clock_is_reset_only_when_it_set_clocks(nvml: FakeNvml, control: str,  # noqa: F811
                                                            resets: bool) -> None:
    specs = build_commands(_args("--attention-workers", "1", "--ffn-workers", "1", "--gpu-control", control))
    hook = reset_clock_hook(specs)
    hook(ChildExit("ffn-0", "ffn-worker", pid=1, returncode=-9, killed=True))
    resets_called = [args for name, args in nvml.calls if name == "nvmlDeviceResetGpuLockedClocks"]
    if resets:
        assert resets_called == [("handle1",)]  # ffn-0 ran on the second GPU
    else:
        assert resets_called == []
    hook(ChildExit("gateway", "gateway", pid=2, returncode=1, killed=False))  # not a worker: nothing
    assert len([n for n, _ in nvml.calls if n == "nvmlDeviceResetGpuLockedClocks"]) == (1 if resets else 0)

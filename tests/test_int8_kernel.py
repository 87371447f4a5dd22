"""The fused VNNI int8 kernel: present wherever the machine can build and run it, and bit-identical
to Int8Linear's torch path (so switching backends never changes a token)."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared.model.checkpoint import open_checkpoint
from shared.model.engine import Engine
from shared.model.int8_kernel import kernel_status
from shared.model.quant import Int8Linear
from shared.model.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def _machine_can_run_kernel() -> bool:
    """x86-64 with AVX-512 VNNI (from /proc/cpuinfo) and a C++ compiler: then the kernel must load."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    return (platform.machine().lower() in ("x86_64", "amd64") and " avx512_vnni" in flags
            and shutil.which("c++") is not None)


def test_kernel_is_used_where_the_machine_can_run_it() -> None:
    status = kernel_status()
    if _machine_can_run_kernel():
        assert status.kernel is not None, status.reason
        assert status.reason == ""
        assert Int8Linear(torch.randn(8, 64)).backend == "vnni"
    else:
        assert status.kernel is None and status.reason
        assert Int8Linear(torch.randn(8, 64)).backend == "torch"


@pytest.mark.parametrize(("out_features", "in_features", "rotate", "with_bias"), [
    (960, 576, True, False),    # SmolLM2 qkv: 64-blocks, several 64-column panels
    (576, 576, False, False),   # o_proj: no rotation
    (200, 1536, True, True),    # a last panel of 8 columns, bias
    (33, 96, True, False),      # 32-blocks (small butterflies), 33 columns
    (70, 42, True, True),       # K not a multiple of 4 (padded groups), 2-blocks
])
def test_kernel_is_bit_identical_to_the_torch_path(out_features: int, in_features: int, rotate: bool,
                                                   with_bias: bool) -> None:
    torch.manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features) if with_bias else None
    reference = Int8Linear(weight, bias, rotate, use_kernel=False)
    fused = Int8Linear(weight, bias, rotate)
    assert reference.backend == "torch"
    for rows in (1, 2, 5, 6, 7, 16, 37):
        x = torch.randn(rows, in_features) * 3
        x[:, 1] *= 60.0  # an outlier channel
        x[-1] = 0.0      # an all-zero row (the scale floor)
        torch.testing.assert_close(fused(x), reference(x), rtol=0, atol=0)


def test_engine_tokens_do_not_depend_on_the_backend(tiny_checkpoints: dict[str, Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.model import int8_kernel

    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[5, 17, 33, 101, 7], [1, 2, 3], [250, 11, 64, 3, 9, 8, 7]]
    results = []
    for choice in ("auto", "torch"):
        monkeypatch.setenv("AFLEX_INT8_KERNEL", choice)
        engine = Engine.from_checkpoint(open_checkpoint(str(tiny_checkpoints["llama"])), quantize="int8",
                                        num_kv_blocks=64, block_size=4)
        backends = {m.backend for m in engine.ffn.modules() if isinstance(m, Int8Linear)}
        assert backends == ({"torch"} if choice == "torch" or int8_kernel.load_kernel() is None else {"vnni"})
        results.append([c.token_ids for c in engine.generate(prompts, params)])
    assert results[0] == results[1]


def test_unknown_kernel_choice_is_a_clear_error() -> None:
    # a fresh interpreter: the choice is read once per process
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "--model", "default", "--quantize", "int8",
         "--prompt-ids", "1,2", "--max-tokens", "1"],
        cwd=ROOT, env={"AFLEX_INT8_KERNEL": "fast", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
        timeout=120)
    assert result.returncode != 0
    assert "AFLEX_INT8_KERNEL='fast'" in result.stderr and "Traceback" not in result.stderr

"""The AFlex CPU kernels (shared/model/kernels/*.cpp): built once per machine, or the torch ops.

- `int8_linear`: `Int8Linear`'s W8A8 product as one operator. At decode batch sizes the torch
  path is ~18 small ops per linear around oneDNN's `_int_mm`; the kernel quantises each row in
  one pass, multiplies with AVX-512 VNNI on weights packed once, and rescales in registers (2-3x
  faster per step on SmolLM2, docs/benchmarks.md). Bit-identical to the torch path.
- `decode_attention`: one-token attention read straight from the paged float32 KV cache, instead
  of gathering every context into a padded copy and running a masked SDPA.

Both are checked against the torch path by tests/shared/model/test_cpu_kernels.py.

Why built at run time (torch.utils.cpp_extension, g++ and ninja, ~30 s on the first use, then
cached under TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions): the wheel stays pure Python and
the kernels are compiled for the machine they run on. Where they cannot be built or run (no
compiler, a CPU without AVX-512 VNNI, not x86-64) or `AFLEX_CPU_KERNELS=torch`, the torch paths
run and `kernel_status()` says why.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from torch import Tensor

from shared.errors import AFlexError

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).with_name("kernels")
SOURCES = ("int8_linear.cpp", "decode_attention.cpp", "bindings.cpp")
KERNEL_CHOICES = ("auto", "torch")
_EXTENSION_NAME = "aflex_cpu_kernels"
STALE_LOCK_S = 600.0  # a build lock this old was left by a process killed mid-build (a build takes ~30-45 s)


class CPUKernelError(AFlexError):
    """`AFLEX_CPU_KERNELS` names no kernel choice."""


@dataclass(frozen=True)
class CPUKernels:
    """The loaded extension behind a typed face (the module itself is untyped)."""

    module: Any

    def pack(self, weight: Tensor) -> Tensor:
        """int8 [N, K] -> uint8 panels [ceil(N/64), ceil(K/4), 256] (weights + 128, laid out for vpdpbusd)."""
        packed: Tensor = self.module.pack_weight(weight)
        return packed

    def int8_linear(self, rows: Tensor, packed: Tensor, weight_scale: Tensor, bias: Tensor | None, block: int,
                    out_features: int) -> Tensor:
        """rows [M, K] float32 -> [M, N] float32, as Int8Linear's torch path computes it, bit for bit."""
        y: Tensor = self.module.int8_linear(rows, packed, weight_scale, bias, block, out_features)
        return y

    def decode_attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, lengths: Tensor) -> Tensor:
        """q [B, H, hd], caches [S, Hkv, hd] float32, slots [B, C], lengths [B] -> [B, H, hd]."""
        out: Tensor = self.module.decode_attention(q, k_cache, v_cache, slots, lengths)
        return out


@dataclass(frozen=True)
class KernelStatus:
    kernels: CPUKernels | None
    reason: str  # why the torch paths run instead ("" when the kernels run)


def kernel_choice() -> str:
    """AFLEX_CPU_KERNELS: `auto` (the kernels where they build and run) or `torch` (never)."""
    choice = os.environ.get("AFLEX_CPU_KERNELS", "auto").strip().lower() or "auto"
    if choice not in KERNEL_CHOICES:
        raise CPUKernelError(f"AFLEX_CPU_KERNELS={choice!r}: choose one of {', '.join(KERNEL_CHOICES)}")
    return choice


def _build() -> Any:
    from torch.utils.cpp_extension import load

    # pip's ninja lives beside this interpreter, which need not be on PATH (a venv not activated)
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    _drop_stale_lock()
    log.info("loading the CPU kernels (compiled once per machine, ~30 s the first time)")
    return load(name=_EXTENSION_NAME, sources=[str(KERNEL_DIR / name) for name in SOURCES],
                extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp"], verbose=False)


def _drop_stale_lock() -> None:
    """torch waits forever on the build directory's lock file; a process killed while building (a
    worker SIGKILLed in its first microbatch) leaves it behind, and every later worker would hang."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(_EXTENSION_NAME, verbose=False)) / "lock"
    try:
        age_s = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age_s > STALE_LOCK_S:
        log.warning("removing a CPU-kernel build lock left %.0f s ago by a process that did not finish: %s",
                    age_s, lock)
        lock.unlink(missing_ok=True)


@cache
def _status(choice: str) -> KernelStatus:
    if choice == "torch":
        return KernelStatus(None, "AFLEX_CPU_KERNELS=torch")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return KernelStatus(None, f"the kernels are for x86-64 CPUs, this one is {platform.machine()}")
    try:
        module = _build()
    except Exception as exc:  # a missing compiler or ninja, a failed build: the torch paths still run
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        log.warning("CPU kernels unavailable, using torch ops: %s", first_line)
        return KernelStatus(None, f"the kernels could not be built: {first_line}")
    if not module.has_avx512_vnni():
        return KernelStatus(None, "this CPU has no AVX-512 VNNI")
    return KernelStatus(CPUKernels(module), "")


def kernel_status() -> KernelStatus:
    """The kernels this process uses (built on first call), or why there are none."""
    return _status(kernel_choice())


def load_kernels() -> CPUKernels | None:
    return kernel_status().kernels

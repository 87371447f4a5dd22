"""The fused W8A8 CPU kernel (kernels/int8_linear.cpp): built once per machine, or the torch ops.

Why a compiled kernel: at decode batch sizes `Int8Linear`'s torch path is ~18 small ops per
linear around oneDNN's `_int_mm`; the kernel quantises each row in one pass, multiplies with
AVX-512 VNNI on weights packed once, and rescales in registers: 2-3x faster per step on
SmolLM2 (docs/benchmarks.md). Its results are bit-identical to the torch path (tests/test_int8_kernel.py),
so which one runs changes the speed, never a token.

Why built at run time (torch.utils.cpp_extension, g++ and ninja, ~25 s on the first use, then
cached under TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions): the wheel stays pure Python and
the kernel is compiled for the machine it runs on. Where it cannot be built or run (no compiler,
a CPU without AVX-512 VNNI, not x86-64) or `AFLEX_INT8_KERNEL=torch`, the torch path runs and
`kernel_status()` says why.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from torch import Tensor

from shared.errors import AFlexError

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "int8_linear.cpp"
KERNEL_CHOICES = ("auto", "torch")
_EXTENSION_NAME = "aflex_int8_linear"


class Int8KernelError(AFlexError):
    """`AFLEX_INT8_KERNEL` names no kernel choice."""


@dataclass(frozen=True)
class Int8Kernel:
    """The loaded extension behind a typed face (the module itself is untyped)."""

    module: Any

    def pack(self, weight: Tensor) -> Tensor:
        """int8 [N, K] -> uint8 panels [ceil(N/64), ceil(K/4), 256] (weights + 128, laid out for vpdpbusd)."""
        packed: Tensor = self.module.pack_weight(weight)
        return packed

    def linear(self, rows: Tensor, packed: Tensor, weight_scale: Tensor, bias: Tensor | None, block: int,
               out_features: int) -> Tensor:
        """rows [M, K] float32 -> [M, N] float32, as Int8Linear's torch path computes it, bit for bit."""
        y: Tensor = self.module.int8_linear(rows, packed, weight_scale, bias, block, out_features)
        return y


@dataclass(frozen=True)
class KernelStatus:
    kernel: Int8Kernel | None
    reason: str  # why the torch path runs instead ("" when the kernel runs)


def kernel_choice() -> str:
    """AFLEX_INT8_KERNEL: `auto` (the kernel where it builds and runs) or `torch` (never the kernel)."""
    choice = os.environ.get("AFLEX_INT8_KERNEL", "auto").strip().lower() or "auto"
    if choice not in KERNEL_CHOICES:
        raise Int8KernelError(f"AFLEX_INT8_KERNEL={choice!r}: choose one of {', '.join(KERNEL_CHOICES)}")
    return choice


def _build() -> Any:
    from torch.utils.cpp_extension import load

    # pip's ninja lives beside this interpreter, which need not be on PATH (a venv not activated)
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    log.info("loading the int8 kernel (compiled once per machine, ~25 s the first time)")
    return load(name=_EXTENSION_NAME, sources=[str(SOURCE)], extra_cflags=["-O3", "-ffp-contract=off"],
                verbose=False)


@cache
def _status(choice: str) -> KernelStatus:
    if choice == "torch":
        return KernelStatus(None, "AFLEX_INT8_KERNEL=torch")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return KernelStatus(None, f"the kernel is for x86-64 CPUs, this one is {platform.machine()}")
    try:
        module = _build()
    except Exception as exc:  # a missing compiler or ninja, a failed build: the torch path still runs
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        log.warning("int8 kernel unavailable, using torch ops: %s", first_line)
        return KernelStatus(None, f"the kernel could not be built: {first_line}")
    if not module.has_avx512_vnni():
        return KernelStatus(None, "this CPU has no AVX-512 VNNI")
    return KernelStatus(Int8Kernel(module), "")


def kernel_status() -> KernelStatus:
    """The kernel Int8Linear uses in this process (built on first call), or why there is none."""
    return _status(kernel_choice())


def load_kernel() -> Int8Kernel | None:
    return kernel_status().kernel

"""How long an idle OpenMP thread spins before it sleeps, in a worker that takes turns with another.

An attention worker and an FFN worker on one machine take turns at every layer, a few milliseconds
each. libgomp's default (`GOMP_SPINCOUNT` 300000) keeps an idle team thread spinning for about
9 ms after each parallel region (measured on the 2-core EPYC VM, torch 2.13 CPU), so each half's
idle threads spin through the other half's whole turn on the cores it computes on. Bounded to
`WORKER_SPIN_COUNT`, a thread still spins through the gaps between one layer's operators (tens of
microseconds) but sleeps through the other half's turn, and both halves can use every core.
Measured, 1 + 1 workers on 2 cores, both at 2 threads, 16 sequences decoding: a step takes 206-218 ms
with 10000-100000 spins against 350 ms at the default, and 241 ms for attention 1 + FFN 2 threads
at the default.

libgomp reads the variable once, when it loads (with torch), so this runs before `import torch`.
This module imports nothing that loads torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

__all__ = ["WORKER_SPIN_COUNT", "OpenMPAlreadyLoadedError", "bound_openmp_spin"]

WORKER_SPIN_COUNT = 20_000  # spin iterations (`GOMP_SPINCOUNT`): under 1 ms here, more than a layer's operator gaps
USER_CHOICES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")  # either one set by the user wins


class OpenMPAlreadyLoadedError(RuntimeError):
    """torch (and with it libgomp) is loaded already, so a spin bound set now would not be read."""


def bound_openmp_spin(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Set `GOMP_SPINCOUNT` for this process unless the user chose a spin count or wait policy.

    Returns the value set, or None when the user's choice stands.
    """
    env = os.environ if environ is None else environ
    if any(name in env for name in USER_CHOICES):
        return None
    if environ is None and "torch" in sys.modules:
        raise OpenMPAlreadyLoadedError("bound_openmp_spin must run before torch is imported: "
                                       "libgomp reads GOMP_SPINCOUNT once, when it loads")
    env["GOMP_SPINCOUNT"] = str(WORKER_SPIN_COUNT)
    return env["GOMP_SPINCOUNT"]

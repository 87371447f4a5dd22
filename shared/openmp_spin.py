"""How long an idle OpenMP thread spins before it sleeps, in a worker that takes turns with another.

An attention worker and an FFN worker on one machine take turns at every layer, a few milliseconds
each. libgomp's default (`GOMP_SPINCOUNT` 300000) keeps an idle team thread spinning for about
9 ms after each parallel region (measured on the 2-core EPYC VM, torch 2.13 CPU: a 2-thread product
every 5 ms used 1.08-1.12 CPU seconds a second, against 0.37-0.40 bounded), so each half's idle
threads spin through the other half's turn on the cores it computes on, and burn the CPU time that
the gateway, the scheduler and nats-server need. Bounded to `WORKER_SPIN_COUNT`, a thread still
spins through the gaps between one layer's operators (tens of microseconds) but sleeps through the
other half's turn. On the 2-core VM the bound does not change the decode step measurably (1 + 1
workers at 2 threads, one sitting: 146-150 ms at the default, 130-162 ms bounded); no spin at all
(`OMP_WAIT_POLICY=passive`) was slower, a wake-up per operator.

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

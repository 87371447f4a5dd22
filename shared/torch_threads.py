"""torch's intra-op thread count on threads other than the one that set it.

`torch.set_num_threads(n)` on the main thread is not what MKL's sgemm uses on threads started
later: there it runs on every core while `torch.get_num_threads()` still says n (measured, torch
2.13 CPU: a [1024, 576] x [576, 1536] product on a new thread used 2 OS threads after
`set_num_threads(1)`). A worker whose forwards run on its own threads (the FFN worker's seam
receivers and server) then runs one OpenMP team per forward beside the other half's thread, more
threads than cores, and each barrier waits for a preempted thread. Each such thread applies the
process's count itself, first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["with_torch_threads"]


def with_torch_threads(target: Callable[[], Any]) -> Callable[[], Any]:
    """`target`, run by a new thread once it has applied the process's `torch.set_num_threads` count."""

    def run() -> Any:
        torch.set_num_threads(torch.get_num_threads())  # the process's count: on this thread too
        return target()

    return run

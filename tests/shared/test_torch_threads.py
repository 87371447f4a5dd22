"""A thread started with `with_torch_threads` computes on the process's torch thread count.

Without it, torch (2.13, CPU) runs a large product on a new thread with an OpenMP team of every
core while `torch.get_num_threads()` says 1: the team's extra OS threads appear in /proc/self/task.
"""

from __future__ import annotations

import os
import threading

import torch

from shared.torch_threads import with_torch_threads


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _threads_added_by_a_product(wrap: bool) -> int:
    added: list[int] = []

    def product() -> None:
        before = _os_threads()
        a = torch.randn(512, 512)
        for _ in range(3):
            a @ a
        added.append(_os_threads() - before)

    thread = threading.Thread(target=with_torch_threads(product) if wrap else product)
    thread.start()
    thread.join()
    return added[0]


def test_a_new_thread_keeps_the_processes_thread_count() -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert _threads_added_by_a_product(wrap=True) == 0
    finally:
        torch.set_num_threads(previous)

"""Cold parking on the worker: its weights released once it is parked cold and holds nothing; loaded again to serve.

The global scheduler parks a worker cold where the power saved over the window it expects it out pays
for the model load that brings it back (`shared.policy.parking_state`, the simulator's rule). The
worker keeps its weights until it holds no work (`idle`: an attention worker's sequences and tasks,
an FFN worker's queued frames), then releases them (and on a GPU its cached CUDA memory): its GPU
then draws bare idle (`GPU.release_context`). Work that comes loads them again first: a plan that
makes it serve (at once, in a thread), or a descriptor or frame sent anyway (`ensure_loaded`, which
blocks that worker's serving until the weights are back). Each load's wall time is measured and
logged, and the GPU is charged the simulator's rejoin (`GPU.create_context`: a new context and the
weights over the host link at context-idle power).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable

import torch

from shared.gpu.base import GPU
from shared.kinds import Assignment

log = logging.getLogger("aflex.worker")

CHECK_PERIOD_S = 0.5  # how often a worker parked cold looks whether it has drained


class ColdParking:
    def __init__(self, worker_id: str, gpu: GPU, *, release: Callable[[], None], load: Callable[[], None],
                 idle: Callable[[], bool], weight_bytes: Callable[[], float]) -> None:
        self.worker_id, self.gpu = worker_id, gpu
        self._release, self._load, self._idle, self._weight_bytes = release, load, idle, weight_bytes
        self.cold_wanted = False
        self.released = False
        self.load_s: list[float] = []  # each reload's wall time (measured)
        self._lock = threading.Lock()  # an FFN worker serves on the seam's threads
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Task[None] | None = None

    def assigned(self, assignment: Assignment | None) -> None:
        """The scheduler's assignment (on the event loop): parked cold, release once drained; serving, load now."""
        self.cold_wanted = assignment == "parked-cold"
        if self.cold_wanted and self._task is None:
            self._task = asyncio.create_task(self._watch(), name=f"parking-{self.worker_id}")
        elif not self.cold_wanted and self.released and (self._wake is None or self._wake.done()):
            self._wake = asyncio.create_task(self.ensure_loaded_async(), name=f"wake-{self.worker_id}")

    async def _watch(self) -> None:
        try:
            while self.cold_wanted and not self.released:
                self.maybe_release()
                await asyncio.sleep(CHECK_PERIOD_S)
        finally:
            self._task = None

    def maybe_release(self) -> bool:
        """Release the weights if parked cold and idle; True when it did."""
        with self._lock:
            if not self.cold_wanted or self.released or not self._idle():
                return False
            self._release()
            gc.unfreeze()  # the workers freeze what they loaded (out of the collector's walks): free it now
            gc.collect()
            gc.freeze()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.gpu.release_context()
            self.released = True
        log.info("%s: parked cold: weights released", self.worker_id)
        return True

    def ensure_loaded(self) -> None:
        """Load the weights again if released (blocking: a serving thread, or a thread of the event loop's).
        Called before every forward: unlocked while loaded, since weights are released only while idle."""
        if not self.released:
            return
        with self._lock:
            if not self.released:
                return
            started = time.perf_counter()
            self._load()
            gc.freeze()
            modelled_s = self.gpu.create_context(self._weight_bytes())
            self.released = False
            load_s = time.perf_counter() - started
            self.load_s.append(load_s)
        log.info("%s: weights loaded again in %.2f s (the GPU's modelled rejoin: %.2f s)", self.worker_id, load_s,
                 modelled_s)

    async def ensure_loaded_async(self) -> None:
        if self.released:
            await asyncio.to_thread(self.ensure_loaded)

    async def stop(self) -> None:
        for task in (self._task, self._wake):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

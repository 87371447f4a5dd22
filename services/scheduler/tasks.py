"""The scheduler's background tasks: started, logged if one dies, all cancelled at stop.

One set for every loop the scheduler runs (the health loop, a lane per attention worker, the frequency
window, provisioning, KV handoffs, the beacons), so that stopping the scheduler leaves none behind and
a task that raised is never silent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("aflex.scheduler")


class TaskSet:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("scheduler task %s died", task.get_name(), exc_info=task.exception())

    async def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

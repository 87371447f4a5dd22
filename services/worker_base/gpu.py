"""A worker's GPU: the backend from the settings, its DVFS controller, a meter of its work, telemetry.

The controller follows the scheduler's `FrequencyCommand`s on `freq.<wid>`; a task publishes
`WorkerTelemetry` on `telemetry.<role>.<wid>`, with the assignment the global scheduler last gave
(the meter's, set by presence.py's `RoleFollower`; a warm-parked worker's lowest clock comes as a
frequency command like any other). The clock is reset when the worker starts (one before it may
have died with it locked) and when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from nats.aio.client import Client
from nats.aio.msg import Msg

from shared import subjects
from shared.gpu.controller import DVFSController
from shared.gpu.telemetry import WorkerMeter, publish_loop
from shared.kinds import Role
from shared.messages import FrequencyCommand, ProtocolError, decode

if TYPE_CHECKING:
    from nats.aio.subscription import Subscription

    from shared.gpu.base import GPU
    from shared.settings import WorkerSettings

log = logging.getLogger("aflex.worker")


def emulated_device_file(settings: WorkerSettings) -> Path | None:
    """Where the worker's emulated GPU keeps its locked clock (`gpu_state_dir`), or None."""
    return Path(settings.gpu_state_dir) / f"{settings.worker_id}.json" if settings.gpu_state_dir else None


class WorkerGPU:
    """A worker's GPU, its DVFS controller, its meter and its telemetry publisher.

    `gpu` may be given (tests pass a fake or an emulated GPU); otherwise `select_gpu` builds it from
    the settings when the worker starts, and `stop` closes it. `stop` always resets the clock.
    """

    def __init__(self, settings: WorkerSettings, worker_id: str, role: Role, gpu: GPU | None = None) -> None:
        self.settings, self.worker_id, self.role = settings, worker_id, role
        self._owns_gpu = gpu is None
        self.gpu: GPU = gpu if gpu is not None else self._select()
        self.controller = DVFSController(self.gpu, default_clock_mhz=settings.default_clock_mhz,
                                         hysteresis_mhz=settings.hysteresis_mhz, min_hold_s=settings.min_hold_s)
        self.meter = WorkerMeter(worker_id, role)
        self.commands_ignored = 0
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    def _select(self) -> GPU:
        from shared.gpu.select import select_gpu

        s = self.settings
        return select_gpu(s.gpu_backend, s.gpu_profile, s.gpu_pace, device_file=emulated_device_file(s))

    async def start(self, nc: Client) -> None:
        """Reset the clock (a worker before this one may have died with it locked), follow `freq.<wid>`
        commands, and start publishing telemetry."""
        self.controller.reset()
        self.controller.poll()  # the default clock from the start
        self._stop.clear()
        self._sub = await nc.subscribe(subjects.freq(self.worker_id), cb=self._on_command)
        self._task = asyncio.create_task(
            publish_loop(nc, subjects.telemetry(self.role, self.worker_id), self.meter, self.gpu, self.controller,
                         self.settings.telemetry_hz, self._stop), name=f"telemetry-{self.worker_id}")

    async def _on_command(self, msg: Msg) -> None:
        try:
            cmd = decode(FrequencyCommand, msg.data)
        except ProtocolError as exc:
            self.commands_ignored += 1
            log.warning("%s: ignored a malformed frequency command: %s", self.worker_id, exc)
            return
        if cmd.worker_id != self.worker_id:
            self.commands_ignored += 1
            log.warning("%s: ignored a frequency command for worker %s", self.worker_id, cmd.worker_id)
            return
        clocks = self.controller.apply_command(cmd)
        log.debug("%s: frequency command %s until %.3f (%s)", self.worker_id, clocks, cmd.valid_until_ts,
                  cmd.reason)

    async def stop(self) -> None:
        """Stop telemetry and commands, reset the clock, close the GPU if this worker opened it."""
        self._stop.set()
        try:
            if self._task is not None:
                await asyncio.gather(self._task, return_exceptions=True)
                self._task = None
            if self._sub is not None:
                with contextlib.suppress(Exception):  # connection already gone
                    await self._sub.unsubscribe()
            self._sub = None
        finally:
            self.controller.reset()
            if self._owns_gpu:
                with contextlib.suppress(Exception):
                    self.gpu.close()

"""The scheduler process: connect to NATS, start the `Scheduler`, serve until stopped (SIGTERM: drain first)."""

from __future__ import annotations

import asyncio
import logging

from services.scheduler.model_info import ModelInfo, load_model_info
from services.scheduler.service import Scheduler
from shared.lifecycle import stop_on_signals
from shared.settings import SchedulerSettings
from shared.transport import bus

log = logging.getLogger("aflex.scheduler")


async def run(settings: SchedulerSettings, *, stop: asyncio.Event | None = None,
              model: ModelInfo | None = None) -> None:
    """Run the scheduler until `stop` is set or SIGTERM/SIGINT, then drain: no new requests, the admitted ones
    finish (up to `drain_timeout_s`). `model` overrides reading the model card."""
    if model is None:
        model = await asyncio.to_thread(load_model_info, settings.model)
    scheduler: Scheduler | None = None

    def bus_lost() -> None:
        if scheduler is not None:
            scheduler.on_bus_lost()

    nc = await bus.connect(settings.nats_url, f"aflex-scheduler-{settings.scheduler_id}", on_disconnect=bus_lost,
                           user=settings.nats_user, password=settings.nats_password)
    scheduler = Scheduler(settings, nc, model)
    stop = stop or asyncio.Event()
    try:
        with stop_on_signals(stop):
            await scheduler.start()
            log.info("scheduler %s serving %s on %s", settings.scheduler_id, model.model_id, settings.nats_url)
            await stop.wait()
            log.info("scheduler %s draining (up to %g s)", settings.scheduler_id, settings.drain_timeout_s)
            if await scheduler.drain(settings.drain_timeout_s):
                log.info("scheduler %s drained", settings.scheduler_id)
    finally:
        await scheduler.stop()
        await bus.close(nc)

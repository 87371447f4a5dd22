"""What the scheduler publishes on a timer: its heartbeat (gateways watch it) and its telemetry.

The heartbeat is how a gateway tells a scheduler that is busy from one that is gone: a request whose
scheduler `instance` has gone unheard is resubmitted to whichever scheduler takes over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from nats.aio.client import Client

from shared import subjects
from shared.messages import SchedulerHeartbeat, SchedulerTelemetry, encode
from shared.transport import bus

log = logging.getLogger("aflex.scheduler")


async def heartbeat_loop(nc: Client, scheduler_id: str, instance: str, period_s: float) -> None:
    await bus.publish_every(nc, subjects.SCHED_HEARTBEAT, lambda: encode(SchedulerHeartbeat(
        scheduler_id=scheduler_id, instance=instance, ts=time.time(), reconnects=nc.stats["reconnects"])), period_s)


async def telemetry_loop(nc: Client, scheduler_id: str, hz: float, telemetry: Callable[[], SchedulerTelemetry]
                         ) -> None:
    subject = subjects.telemetry("scheduler", scheduler_id)
    while True:
        await asyncio.sleep(1.0 / hz)
        await nc.publish(subject, encode(telemetry()))

"""Liveness both ways: when each scheduler run was last heard, and the gateway's own heartbeat.

Schedulers publish `SchedulerHeartbeat`s and a request knows which run took it (`SubmitReply.
scheduler_instance`): when that run has sent neither output nor a heartbeat for `scheduler_silence_s`,
the request is resubmitted, as a continuation, to whichever scheduler takes over (`generation.py`).
When its connection or the scheduler run's came back (a NATS node died, say), deltas sent around then
may be lost: `loss_epoch` counts those moments, and a request that sees it move asks for a resync.
The other way, a gateway run's id heads every submission and its `GatewayHeartbeat`s; when they
stop, the schedulers cancel its requests (nobody reads them any more).
"""

from __future__ import annotations

import logging
import math
import time

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared import subjects
from shared.messages import GatewayHeartbeat, ProtocolError, SchedulerHeartbeat, decode, encode
from shared.transport import bus

log = logging.getLogger("aflex.gateway")


class SchedulerWatch:
    def __init__(self) -> None:
        self._heard_mono: dict[str, float] = {}  # scheduler instance -> when its last heartbeat came
        self._reconnects: dict[str, int] = {}  # scheduler instance -> its connection's reconnects, as it said
        self._sub: Subscription | None = None
        self._nc: Client | None = None

    async def subscribe(self, nc: Client) -> None:
        self._nc = nc
        self._sub = await nc.subscribe(subjects.SCHED_HEARTBEAT, cb=self._on_heartbeat)

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            beat = decode(SchedulerHeartbeat, msg.data)
        except ProtocolError as exc:
            log.warning("dropping an invalid scheduler heartbeat: %s", exc)
            return
        self._heard_mono[beat.instance] = time.monotonic()
        self._reconnects[beat.instance] = beat.reconnects

    @property
    def watching(self) -> bool:
        return self._sub is not None

    def loss_epoch(self, instance: str) -> int:
        """Grows whenever this gateway's NATS connection or `instance`'s came back since."""
        own = 0 if self._nc is None else int(self._nc.stats["reconnects"])
        return own + self._reconnects.get(instance, 0)

    def silent_s(self, instance: str) -> float:
        """Seconds since `instance`'s last heartbeat (infinite: never heard)."""
        heard = self._heard_mono.get(instance)
        return math.inf if heard is None else time.monotonic() - heard


async def heartbeat_loop(nc: Client, gateway_id: str, period_s: float) -> None:
    await bus.publish_every(nc, subjects.GATEWAY_HEARTBEAT, lambda: encode(GatewayHeartbeat(
        gateway_id=gateway_id, ts=time.time())), period_s)

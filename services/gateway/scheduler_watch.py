"""When each scheduler run was last heard, so a request can tell a busy scheduler from a gone one.

Schedulers publish `SchedulerHeartbeat`s; a request knows which run took it (`SubmitReply.
scheduler_instance`). When that run has sent neither output nor a heartbeat for `scheduler_silence_s`,
the request is resubmitted, as a continuation, to whichever scheduler takes over (`generation.py`).
"""

from __future__ import annotations

import logging
import math
import time

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared import subjects
from shared.messages import ProtocolError, SchedulerHeartbeat, decode

log = logging.getLogger("aflex.gateway")


class SchedulerWatch:
    def __init__(self) -> None:
        self._heard_mono: dict[str, float] = {}  # scheduler instance -> when its last heartbeat came
        self._sub: Subscription | None = None

    async def subscribe(self, nc: Client) -> None:
        self._sub = await nc.subscribe(subjects.SCHED_HEARTBEAT, cb=self._on_heartbeat)

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            beat = decode(SchedulerHeartbeat, msg.data)
        except ProtocolError as exc:
            log.warning("dropping an invalid scheduler heartbeat: %s", exc)
            return
        self._heard_mono[beat.instance] = time.monotonic()

    @property
    def watching(self) -> bool:
        return self._sub is not None

    def silent_s(self, instance: str) -> float:
        """Seconds since `instance`'s last heartbeat (infinite: never heard)."""
        heard = self._heard_mono.get(instance)
        return math.inf if heard is None else time.monotonic() - heard

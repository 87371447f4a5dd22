"""Which gateway runs are alive, so that the requests of one that died stop using the GPUs.

Every gateway beats on `gateway.heartbeat` with an id new at each start, and every submission names
its gateway. A gateway unheard for `gateway_silence_s` is gone, and its clients' connections with it:
nobody will read those requests' tokens, so the scheduler cancels them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from nats.aio.msg import Msg

from services.scheduler.state import RequestState
from shared.messages import GatewayHeartbeat, decode

log = logging.getLogger("aflex.scheduler")


class GatewayWatch:
    def __init__(self, silence_s: float) -> None:
        self.silence_s = silence_s
        self._heard_mono: dict[str, float] = {}  # gateway id -> when it was last heard (or submitted)

    def heard(self, gateway_id: str, now: float) -> None:
        if gateway_id:
            self._heard_mono[gateway_id] = now

    async def on_heartbeat(self, msg: Msg) -> None:
        self.heard(decode(GatewayHeartbeat, msg.data).gateway_id, time.monotonic())

    def orphans(self, now: float, requests: Iterable[RequestState]) -> list[RequestState]:
        """The unfinished requests of every gateway found gone now."""
        gone = set(self.gone(now))
        orphans = [r for r in requests if r.gateway_id in gone and not r.finished]
        for gateway_id in gone:
            log.warning("gateway %s is gone: cancelling its %d requests", gateway_id,
                        sum(r.gateway_id == gateway_id for r in orphans))
        return orphans

    def gone(self, now: float) -> list[str]:
        """Gateways silent for longer than `silence_s`, forgotten as they are returned."""
        silent = [g for g, at in self._heard_mono.items() if now - at > self.silence_s]
        for gateway_id in silent:
            del self._heard_mono[gateway_id]
        return silent

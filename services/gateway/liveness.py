"""Liveness both ways: when each scheduler run was last heard, and the gateway's own heartbeat.

Schedulers publish `SchedulerHeartbeat`s and a request knows which run took it (`SubmitReply.
scheduler_instance`): when that run has sent neither output nor a heartbeat for `scheduler_silence_s`,
the request is resubmitted, as a continuation, to whichever scheduler takes over (`generation.py`).
When its connection or the scheduler run's came back (a NATS node died, say), deltas sent around then
may be lost: `loss_epoch` counts those moments, and a request that sees it move asks for a resync.
A cancel sent around such a moment may be lost too (NATS core is at most once), and its request would
run on unread to max_tokens: the watch keeps the recent cancels and sends each again when its
scheduler run's loss epoch moves. The other way, a gateway run's id heads every submission and its
`GatewayHeartbeat`s; when they stop, the schedulers cancel its requests (nobody reads them any more).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared import subjects
from shared.messages import CancelRequest, GatewayHeartbeat, ProtocolError, SchedulerHeartbeat, decode, encode
from shared.transport import bus

log = logging.getLogger("aflex.gateway")

CANCEL_MEMORY_S = 120.0  # a cancel is sent again on a loss epoch's move for this long
MAX_CANCELS = 10_000  # and at most this many are kept (the oldest go first)


@dataclass
class _Cancel:
    cancel: CancelRequest
    instance: str  # the scheduler run that held the request
    epoch: int  # its loss epoch when the cancel was (last) sent
    mono: float  # when it was first sent


class SchedulerWatch:
    def __init__(self) -> None:
        self._heard_mono: dict[str, float] = {}  # scheduler instance -> when its last heartbeat came
        self._reconnects: dict[str, int] = {}  # scheduler instance -> its connection's reconnects, as it said
        self._sub: Subscription | None = None
        self._nc: Client | None = None
        self._cancels: dict[str, _Cancel] = {}  # request id -> its cancel, oldest first
        self._epochs: dict[str, int] = {}  # scheduler instance -> its loss epoch when its cancels were last checked

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
        epoch = self.loss_epoch(beat.instance)
        if self._epochs.get(beat.instance, epoch) != epoch:
            await self._cancel_again(beat.instance, epoch)
        self._epochs[beat.instance] = epoch

    def cancelled(self, cancel: CancelRequest, instance: str) -> None:
        """`cancel` was published (or tried) for a request `instance` held: keep it to send again."""
        if not instance:
            return
        now = time.monotonic()
        self._cancels.pop(cancel.request_id, None)
        self._cancels[cancel.request_id] = _Cancel(cancel, instance, self.loss_epoch(instance), now)
        self._epochs.setdefault(instance, self.loss_epoch(instance))
        while self._cancels:
            oldest = next(iter(self._cancels.values()))
            if now - oldest.mono <= CANCEL_MEMORY_S and len(self._cancels) <= MAX_CANCELS:
                break
            del self._cancels[oldest.cancel.request_id]

    async def _cancel_again(self, instance: str, epoch: int) -> None:
        """Send `instance`'s recent cancels again: its connection or ours came back since they were sent."""
        assert self._nc is not None
        now = time.monotonic()
        again = [c for c in self._cancels.values()
                 if c.instance == instance and c.epoch != epoch and now - c.mono <= CANCEL_MEMORY_S]
        for entry in again:
            entry.epoch = epoch
            try:
                await self._nc.publish(subjects.req_cancel(entry.cancel.request_id), encode(entry.cancel))
            except Exception as exc:  # reconnecting again: the next epoch's move sends it
                log.warning("%s: could not send its cancel again: %s", entry.cancel.request_id, exc)
                return
        if again:
            log.info("sent %d cancels again to scheduler run %s: a NATS connection came back", len(again), instance)

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

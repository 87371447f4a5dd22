"""Which FFN workers are alive, and where their seams are, from their heartbeats: a hop waiting on a
dead one fails early, and a hop to a new one knows the seam address to open.

An FFN worker that dies takes the seam frames it was serving with it, and nothing tells the attention
worker: without this, each waiting hop would sit until `ffn_reply_timeout_s` (30 s by default, long
enough for the largest prefill forward) before its microbatch failed and the scheduler re-ran it
with another FFN worker. Every worker's heartbeat is an ordinary NATS message on
`aflex.v1.control.heartbeat.<wid>`, so the attention worker listens to the FFN workers' too: a hop
whose FFN worker has sent no heartbeat for `silence_s` since the hop was sent fails then (5 s by
default, the scheduler's own `heartbeat_timeout_s`, so both call a worker dead on the same evidence).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared import subjects
from shared.messages import Heartbeat, ProtocolError, decode

log = logging.getLogger("aflex.attention_worker")


class FFNWatch:
    """Hops in flight by FFN worker, checked against the FFN workers' heartbeats every `check_s`."""

    def __init__(self, silence_s: float, on_silent: Callable[[tuple[str, int], str, float], None]) -> None:
        self.silence_s = silence_s
        self.on_silent = on_silent  # (hop key, FFN worker, seconds silent): fail that hop
        self.check_s = max(0.05, min(0.5, silence_s / 4))
        self._seen: dict[str, float] = {}  # FFN worker -> time.monotonic() of its last heartbeat
        self.addresses: dict[str, str] = {}  # FFN worker -> the seam address of its last heartbeat
        self._address_known: dict[str, asyncio.Event] = {}
        self._hops: dict[tuple[str, int], tuple[str, float]] = {}  # (mb_id, layer) -> (FFN worker, sent)
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, nc: Client) -> None:
        self._sub = await nc.subscribe(subjects.CONTROL_HEARTBEAT_ALL, cb=self._on_heartbeat)
        if self.silence_s > 0:  # else switched off: hops wait for their reply timeout
            self._task = asyncio.create_task(self._check_loop(), name="ffn-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sub is not None:
            with contextlib.suppress(Exception):  # the connection is already gone
                await self._sub.unsubscribe()
            self._sub = None

    def track(self, key: tuple[str, int], ffn_worker: str, now: float | None = None) -> None:
        self._hops[key] = (ffn_worker, time.monotonic() if now is None else now)

    def untrack(self, key: tuple[str, int]) -> None:
        self._hops.pop(key, None)

    def last_heard(self, ffn_worker: str) -> float | None:
        """time.monotonic() of the FFN worker's last heartbeat, None if never heard."""
        return self._seen.get(ffn_worker)

    def ffn_workers_in_flight(self) -> set[str]:
        return {ffn_worker for ffn_worker, _ in self._hops.values()}

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            beat = decode(Heartbeat, msg.data)
        except ProtocolError:
            return  # not ours to judge; the scheduler logs bad heartbeats
        self.heard(beat.worker_id, beat.role, time.monotonic(), beat.seam_address)

    def heard(self, worker_id: str, role: str, now: float, seam_address: str = "") -> None:
        """A heartbeat from `worker_id` at `now` (time.monotonic()); only FFN workers' count."""
        if role != "ffn":
            return
        self._seen[worker_id] = now
        if seam_address:
            self.addresses[worker_id] = seam_address
            self._address_known.setdefault(worker_id, asyncio.Event()).set()

    async def address_of(self, ffn_worker: str, timeout_s: float) -> str:
        """The FFN worker's seam address, waiting up to `timeout_s` for its first heartbeat."""
        if ffn_worker not in self.addresses:
            known = self._address_known.setdefault(ffn_worker, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(known.wait(), timeout_s)
        return self.addresses.get(ffn_worker, "")

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(self.check_s)
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        """Report every hop whose FFN worker has been silent for `silence_s` since the hop was sent."""
        for key, (ffn_worker, sent) in list(self._hops.items()):
            silent_s = now - max(self._seen.get(ffn_worker, sent), sent)
            if silent_s > self.silence_s:
                del self._hops[key]
                self.on_silent(key, ffn_worker, silent_s)

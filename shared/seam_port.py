"""Where a worker's seam frames go out and come in: the lean seam link, or the service's nats-py client.

Both workers talk to the seam through this one small interface, so the transport is a setting
(`seam_transport`, env `AFLEX_SEAM_TRANSPORT`) and not a code path of its own in each worker:

- `lean` (default): `seam_link.SeamLink`, a second connection to the same NATS server that delivers
  each message inside the socket read and writes each publish at once (see its docstring for why);
- `nats-py`: the worker's ordinary nats-py connection, for servers the lean link does not speak to
  (TLS, NKey/JWT credentials).

Handlers get `(subject, payload)` with `payload` a writable `bytearray` of their own, called
synchronously: they hand work on (a queue, a future), and a subscriber's `after_batch()` runs once
everything that arrived together has been handed over (after the socket read on the lean link, on
the loop's next turn on nats-py), which is where the FFN worker serves what queued. `publish` is
synchronous too, so a worker can answer from a plain callback: on the lean link the bytes are on
the socket when it returns; on nats-py they go out from a task on the loop's next turn (in order).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Literal, Protocol

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared import bus
from shared.seam_link import Handler, SeamLink

log = logging.getLogger("aflex.seam_port")

SeamTransport = Literal["lean", "nats-py"]


class SeamPort(Protocol):
    @property
    def max_payload(self) -> int: ...

    async def subscribe(self, subject: str, handler: Handler, after_batch: Callable[[], None] | None = None
                        ) -> None: ...

    def publish(self, subject: str, payload: bytes) -> None: ...

    async def stop_receiving(self) -> None: ...

    def on_disconnect(self, listener: Callable[[], None]) -> None: ...

    async def close(self) -> None: ...


class LeanSeamPort:
    """The seam on its own lean NATS connection."""

    def __init__(self, link: SeamLink) -> None:
        self.link = link
        self._sids: list[int] = []

    @property
    def max_payload(self) -> int:
        return self.link.max_payload

    async def subscribe(self, subject: str, handler: Handler, after_batch: Callable[[], None] | None = None
                        ) -> None:
        """`after_batch()` runs right after each socket read that delivered messages (inline: no loop turn)."""
        self._sids.append(self.link.subscribe(subject, handler))
        if after_batch is not None:
            self.link.after_each_read(after_batch)
        await self.link.flush()  # subscribed at the server when this returns, as nats-py's subscribe+flush

    def publish(self, subject: str, payload: bytes) -> None:
        self.link.publish(subject, payload)

    def on_disconnect(self, listener: Callable[[], None]) -> None:
        self.link.on_disconnect(listener)

    async def stop_receiving(self) -> None:
        for sid in self._sids:
            self.link.unsubscribe(sid)
        self._sids.clear()

    async def close(self) -> None:
        """Stop taking frames, then close the link (after flushing what was written)."""
        await self.stop_receiving()
        await self.link.close()


class NatsPySeamPort:
    """The seam on the service's nats-py connection (which it does not close: the service does)."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self._subs: list[Subscription] = []
        self._sends: set[asyncio.Task[None]] = set()

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload

    async def subscribe(self, subject: str, handler: Handler, after_batch: Callable[[], None] | None = None
                        ) -> None:
        """nats-py hands over one message at a time: `after_batch()` runs on the loop's next turn, once
        whatever else nats-py has already read was handed over too."""
        async def deliver(msg: Msg) -> None:
            handler(msg.subject, bytearray(msg.data))
            if after_batch is not None:
                asyncio.get_running_loop().call_soon(after_batch)

        self._subs.append(await self.nc.subscribe(subject, cb=deliver))
        await self.nc.flush()

    def publish(self, subject: str, payload: bytes) -> None:
        task = asyncio.get_running_loop().create_task(self._send(subject, payload))
        self._sends.add(task)  # tasks start in creation order, so messages keep theirs
        task.add_done_callback(self._sends.discard)

    async def _send(self, subject: str, payload: bytes) -> None:
        try:
            await bus.publish_now(self.nc, subject, payload)
        except Exception as exc:  # lost connection, bad subject: the waiting side times out and says so
            log.warning("seam publish to %s failed: %s", subject, exc)

    def on_disconnect(self, listener: Callable[[], None]) -> None:
        """Not called: nats-py keeps what is published while disconnected and sends it on reconnect."""

    async def close(self) -> None:
        await self.stop_receiving()
        if self._sends:
            await asyncio.gather(*self._sends, return_exceptions=True)

    async def stop_receiving(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):  # the connection is already gone: nothing left to stop
                await sub.unsubscribe()
        self._subs.clear()


async def open_seam_port(transport: SeamTransport, url: str, name: str, nc: Client) -> SeamPort:
    """The seam port `transport` names: a new lean link to `url`, or `nc` itself."""
    if transport == "nats-py":
        return NatsPySeamPort(nc)
    return LeanSeamPort(await SeamLink.connect(url, f"{name}-seam"))

"""The `nats` seam: frames as NATS messages on the worker's nats-py connection (the fallback).

For meshes whose workers reach each other only through the NATS server. Each end listens on
`aflex.v1.seam.<wid>` (its address); a frame is one message, `SeamHeader.pack()` then the tensor's
bytes, published with the sender's address as the reply subject. A frame longer than the server's
max_payload is split: the first message holds the header, the rest are bare continuations, which
NATS delivers in order from one publisher, so the receiver joins them by sender. A reply carries
its request's `reply_tag`, which resolves the request's future. Everything runs on the event loop.

NATS cannot tell that a peer died: the workers learn that from heartbeats and `drop` the peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from torch import Tensor

from shared import subjects
from shared.transport.header import HEADER_BYTES, SeamFrameError, SeamHeader, as_bytes
from shared.transport.seam import Frame, OnFrame, OnPeerLost, Peer, SeamError

log = logging.getLogger("aflex.seam")


@dataclass
class _Partial:
    header: SeamHeader
    data: bytearray


def _tensor(header: SeamHeader, data: bytearray | memoryview) -> Tensor:
    if header.nbytes == 0:
        return torch.empty(header.shape, dtype=header.dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(header.dtype).view(header.shape)


class NatsSeam:
    def __init__(self, worker_id: str, nc: Client, on_frame: OnFrame, on_peer_lost: OnPeerLost) -> None:
        self.worker_id, self.nc = worker_id, nc
        self.on_frame, self.on_peer_lost = on_frame, on_peer_lost
        self._address = subjects.seam(worker_id)
        self._sub: Subscription | None = None
        self._partials: dict[str, _Partial] = {}  # by sender address
        self._sends: set[asyncio.Task[None]] = set()
        self._tags = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._waiting: dict[int, tuple[Peer, asyncio.Future[Frame]]] = {}  # by reply tag

    @property
    def address(self) -> str:
        return self._address

    async def start(self) -> None:
        self._loop, self._loop_thread = asyncio.get_running_loop(), threading.get_ident()
        self._sub = await self.nc.subscribe(self._address, cb=self._on_msg)
        await self.nc.flush()

    async def connect(self, peer: Peer) -> None:
        """Nothing to open: the NATS server routes by subject."""

    async def request(self, peer: Peer, header: SeamHeader, tensor: Tensor, *, timeout_s: float,
                      block: bool = False, after_send: Callable[[], None] | None = None) -> Frame:
        """`block` has no meaning here: replies come through the event loop."""
        tag = next(self._tags)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Frame] = loop.create_future()
        self._waiting[tag] = (peer, future)
        timer = loop.call_later(timeout_s, self._expire, tag, timeout_s)
        try:
            self._send(peer, dataclasses.replace(header, reply_tag=tag), tensor)
            if after_send is not None:
                after_send()
            return await future
        finally:
            timer.cancel()
            self._waiting.pop(tag, None)

    def reply(self, request: Frame, header: SeamHeader, tensor: Tensor) -> None:
        """From any thread (the FFN worker's server thread too): the messages are queued on the loop."""
        header = dataclasses.replace(header, reply_tag=request.header.reply_tag)
        loop = self._loop
        assert loop is not None
        if threading.get_ident() == self._loop_thread:
            self._send(request.peer, header, tensor)
        else:
            loop.call_soon_threadsafe(self._send, request.peer, header, tensor.detach().cpu())

    def _send(self, peer: Peer, header: SeamHeader, tensor: Tensor) -> None:
        """Queue the frame's messages (nats-py writes them on the loop's next turn, in order)."""
        if self.nc.is_closed:
            raise SeamError(f"seam to {peer.worker_id}: the NATS connection is closed")
        payload = as_bytes(tensor.detach().cpu()).numpy().data
        room = self.nc.max_payload - HEADER_BYTES
        messages = [header.pack() + payload[:room]]
        step = self.nc.max_payload
        messages += [bytes(payload[start:start + step]) for start in range(room, len(payload), step)]
        task = asyncio.get_running_loop().create_task(self._publish(peer, messages))
        self._sends.add(task)  # tasks start in creation order, so frames keep theirs
        task.add_done_callback(self._sends.discard)

    async def _publish(self, peer: Peer, messages: list[bytes]) -> None:
        try:
            for message in messages:
                await self.nc.publish(peer.address, message, reply=self._address)
        except Exception as exc:  # a lost connection, a bad subject: the waiting side fails on its own watch
            log.warning("seam to %s on %s failed: %s", peer.worker_id, peer.address, exc)

    def _expire(self, tag: int, timeout_s: float) -> None:
        peer, future = self._waiting.pop(tag, (None, None))
        if future is not None and not future.done():
            future.set_exception(SeamError(f"no reply from {peer.worker_id if peer else '?'} within {timeout_s:.0f} s"))

    async def _on_msg(self, msg: Msg) -> None:
        sender = msg.reply
        try:
            partial = self._partials.pop(sender, None)
            if partial is None:
                header = SeamHeader.unpack(msg.data)
                partial = _Partial(header, bytearray(memoryview(msg.data)[HEADER_BYTES:]))
            else:
                partial.data += msg.data
            if len(partial.data) < partial.header.nbytes:
                self._partials[sender] = partial  # more to come from this sender
                return
            if len(partial.data) > partial.header.nbytes:
                raise SeamFrameError(f"frame carries {len(partial.data)} bytes, header says {partial.header.nbytes}")
            frame = Frame(Peer(sender.rsplit(".", 1)[-1], sender), partial.header,
                          _tensor(partial.header, partial.data))
            _, future = self._waiting.pop(frame.header.reply_tag, (None, None))
            if future is None:
                self.on_frame(frame)  # a request (a listener has no requests of its own waiting)
            elif not future.done():
                future.set_result(frame)
        except Exception as exc:  # a malformed frame must never take the subscription down
            log.warning("seam: dropped a message from %s on %s: %s", sender or "?", self._address, exc)

    def drop(self, peer: Peer, reason: str) -> None:
        """Forget a half-received frame from `peer` and fail the requests waiting on it (NATS itself
        never notices a peer go)."""
        self._partials.pop(peer.address, None)
        for waiting_on, future in list(self._waiting.values()):
            if waiting_on.worker_id == peer.worker_id and not future.done():
                future.set_exception(SeamError(f"seam to {peer.worker_id} dropped: {reason}"))
        self.on_peer_lost(peer, reason)

    async def close(self) -> None:
        if self._sends:
            await asyncio.gather(*self._sends, return_exceptions=True)
        if self._sub is not None:
            with contextlib.suppress(Exception):  # the connection is already gone
                await self._sub.unsubscribe()
            self._sub = None

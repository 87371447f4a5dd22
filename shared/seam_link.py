"""The seam's own NATS connection: the NATS client protocol, spoken straight from `data_received`.

A decode step crosses the attention/FFN seam twice per layer per microbatch (60 messages per
microbatch on SmolLM2), so every microsecond a message spends in the client is paid 60 times per
token, on the critical path. nats-py hands each message through its parser, a `Msg` object, a
per-subscription queue and a task (one more turn of the event loop), and queues each publish for a
flusher task; profiled in a depth-2 mesh, that machinery cost the attention worker more CPU than
its own attention kernels. This link speaks the same protocol (INFO, CONNECT, PING/PONG, SUB,
UNSUB, PUB, MSG, +OK/-ERR) on its own TCP connection to the same server: `publish` writes to the
socket before it returns, and a message's payload reaches its subscriber's callback inside the
read that brought it, as a fresh writable `bytearray` (so a tensor can be made on it without
another copy). Same server, same subjects, same frames: to everyone else on the bus it is just
another client.

What it does not speak: TLS, and NKey/JWT credentials. `connect` refuses a `tls://` URL or a
server that requires TLS with a `SeamLinkError` that says to run the seam on nats-py instead
(`AFLEX_SEAM_TRANSPORT=nats-py`, see `seam_port.py`). URLs may carry `user:password@` or `token@`.

Like `bus.connect`, it logs disconnects, reconnects, errors and closure under the service's name,
reconnects forever once it has connected (re-subscribing), pings the server every
`ping_interval_s` and treats `max_outstanding_pings` unanswered pings as a dead connection. A
publish while disconnected raises `SeamLinkError`, and `on_disconnect` listeners hear of every drop:
nothing is buffered, because a seam frame that could not go (or whose answer may have been lost
with the connection) is a failed microbatch, which the scheduler recomputes, not a message to
replay later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import unquote, urlsplit

import orjson

from shared.errors import AFlexError

log = logging.getLogger("aflex.seam_link")

PROTOCOL_VERSION = "aflex-seam/1"
MAX_WRITE_BUFFER_BYTES = 64 * 1024 * 1024  # a socket backed up this far is a stuck reader, not a burst

Handler = Callable[[str, bytearray], None]  # (subject, payload) -> None; runs inside the socket read


class SeamLinkError(AFlexError):
    """The seam link could not connect, was refused, or is not connected to publish."""


@dataclass(frozen=True)
class ServerAddress:
    host: str
    port: int
    user: str = ""
    password: str = ""
    token: str = ""

    @classmethod
    def parse(cls, url: str) -> ServerAddress:
        """`nats://[user:password@|token@]host[:port]` (port 4222 by default)."""
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        if parts.scheme in ("tls", "wss", "ws"):
            raise SeamLinkError(f"the seam link speaks plain TCP, not {parts.scheme}:// ({url}); "
                                "run the seam on nats-py (AFLEX_SEAM_TRANSPORT=nats-py)")
        if parts.scheme != "nats":
            raise SeamLinkError(f"not a NATS URL: {url!r} (expected nats://host:port)")
        if not parts.hostname:
            raise SeamLinkError(f"no host in NATS URL {url!r}")
        try:
            port = parts.port or 4222
        except ValueError:
            raise SeamLinkError(f"bad port in NATS URL {url!r}") from None
        user, password = unquote(parts.username or ""), unquote(parts.password or "")
        if user and parts.password is None:  # nats://token@host
            return cls(parts.hostname, port, token=user)
        return cls(parts.hostname, port, user, password)


class _Wire(asyncio.Protocol):
    """One TCP connection's parser: control lines, then MSG payloads by their byte count."""

    def __init__(self, link: SeamLink) -> None:
        self.link = link
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.msg: tuple[str, int] | None = None  # (subject, sid) of a MSG whose payload is awaited
        self.need = 0  # payload bytes + CRLF still to come for `msg`
        loop = asyncio.get_running_loop()
        self.info: asyncio.Future[dict[str, Any]] = loop.create_future()
        self.pong_waiters: list[asyncio.Future[None]] = []
        self.lost: asyncio.Future[None] = loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def connection_lost(self, exc: Exception | None) -> None:
        reason = SeamLinkError(f"connection to NATS lost: {exc or 'closed by the server'}")
        waiters: list[asyncio.Future[Any]] = [self.info, *self.pong_waiters]
        for future in waiters:
            if not future.done():
                future.set_exception(reason)
        self.pong_waiters.clear()
        if not self.lost.done():
            self.lost.set_result(None)
        self.link._connection_lost(self, exc)

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        pos = 0
        delivered = False
        size = len(buf)
        while True:
            if self.msg is not None:
                end = pos + self.need
                if size < end:
                    break
                payload = buf[pos:end - 2]  # a new bytearray: the subscriber may keep it
                pos = end
                subject, sid = self.msg
                self.msg = None
                self.link._deliver(sid, subject, payload)
                delivered = True
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            line = bytes(buf[pos:eol])
            pos = eol + 2
            if line.startswith(b"MSG "):
                self._on_msg_line(line)
            elif line == b"PING":
                self.write(b"PONG\r\n")
            elif line == b"PONG":
                if self.pong_waiters:
                    waiter = self.pong_waiters.pop(0)
                    if not waiter.done():
                        waiter.set_result(None)
                self.link._pong()
            elif line.startswith(b"INFO "):
                self._on_info(line[5:])
            elif line.startswith(b"-ERR"):
                self._on_error(line[4:].strip().strip(b"'").decode(errors="replace"))
            # +OK (verbose is off) and anything unknown are ignored
        del buf[:pos]
        if delivered:
            self.link._read_done()

    def _on_msg_line(self, line: bytes) -> None:
        # MSG <subject> <sid> [reply-to] <#bytes>
        fields = line.split()
        if len(fields) not in (4, 5):
            log.warning("%s: malformed MSG line from NATS: %r", self.link.name, line[:200])
            return
        self.msg = (fields[1].decode(), int(fields[2]))
        self.need = int(fields[-1]) + 2

    def _on_info(self, body: bytes) -> None:
        try:
            info = orjson.loads(body)
        except orjson.JSONDecodeError:
            log.warning("%s: unreadable INFO from NATS", self.link.name)
            return
        if not self.info.done():
            self.info.set_result(info)
        else:  # a later INFO (cluster changes): only max_payload matters here
            self.link._update_info(info)

    def _on_error(self, message: str) -> None:
        log.warning("%s: NATS error: %s", self.link.name, message)
        error = SeamLinkError(f"NATS refused the seam link: {message}")
        if not self.info.done():
            self.info.set_exception(error)
        for waiter in self.pong_waiters:  # a handshake waiting for its PONG learns why
            if not waiter.done():
                waiter.set_exception(error)
        self.pong_waiters.clear()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def ping(self) -> asyncio.Future[None]:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pong_waiters.append(waiter)
        self.write(b"PING\r\n")
        return waiter


class SeamLink:
    """A NATS connection for seam frames: `subscribe` with plain callbacks, `publish` straight to the socket."""

    def __init__(self, address: ServerAddress, name: str, *, connect_timeout_s: float, reconnect_wait_s: float,
                 ping_interval_s: float, max_outstanding_pings: int) -> None:
        self.address, self.name = address, name
        self.connect_timeout_s, self.reconnect_wait_s = connect_timeout_s, reconnect_wait_s
        self.ping_interval_s, self.max_outstanding_pings = ping_interval_s, max_outstanding_pings
        self.max_payload = 1024 * 1024  # NATS's default until the server's INFO says
        self.reconnects = 0
        self._wire: _Wire | None = None
        self._subs: dict[int, tuple[str, str, Handler]] = {}  # sid -> (subject, queue group, handler)
        self._next_sid = 1
        self._closed = False
        self._outstanding_pings = 0
        self._reconnect_task: asyncio.Task[None] | None = None
        self._ping_task: asyncio.Task[None] | None = None
        self._disconnect_listeners: list[Callable[[], None]] = []
        self._read_callbacks: list[Callable[[], None]] = []

    @classmethod
    async def connect(cls, url: str, name: str, *, connect_timeout_s: float = 5.0, reconnect_wait_s: float = 0.5,
                      ping_interval_s: float = 30.0, max_outstanding_pings: int = 2) -> SeamLink:
        """Connect (one attempt, within `connect_timeout_s`), or raise `SeamLinkError` saying why."""
        link = cls(ServerAddress.parse(url), name, connect_timeout_s=connect_timeout_s,
                   reconnect_wait_s=reconnect_wait_s, ping_interval_s=ping_interval_s,
                   max_outstanding_pings=max_outstanding_pings)
        await link._open()
        link._ping_task = asyncio.create_task(link._ping_loop(), name=f"seam-ping-{name}")
        return link

    @property
    def is_connected(self) -> bool:
        wire = self._wire
        return wire is not None and wire.transport is not None and not wire.transport.is_closing()

    # -- the connection -------------------------------------------------------------------------

    async def _open(self) -> None:
        """One TCP connection and handshake: INFO, CONNECT, every subscription, PING -> PONG."""
        loop = asyncio.get_running_loop()
        a = self.address
        wire = _Wire(self)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.create_connection(lambda: wire, a.host, a.port)
                info = await wire.info
                if info.get("tls_required"):
                    raise SeamLinkError(f"the NATS server at {a.host}:{a.port} requires TLS, which the seam link does "
                                        "not speak; run the seam on nats-py (AFLEX_SEAM_TRANSPORT=nats-py)")
                self._update_info(info)
                options: dict[str, Any] = {"verbose": False, "pedantic": False, "tls_required": False,
                                           "name": self.name, "lang": "python3", "version": PROTOCOL_VERSION,
                                           "protocol": 1, "echo": True, "headers": False, "no_responders": False}
                if a.token:
                    options["auth_token"] = a.token
                elif a.user:
                    options.update(user=a.user, **{"pass": a.password})
                parts = [b"CONNECT " + orjson.dumps(options) + b"\r\n"]
                parts += [self._sub_line(sid, subject, queue) for sid, (subject, queue, _) in self._subs.items()]
                wire.write(b"".join(parts))
                await wire.ping()  # the server answers after it has processed CONNECT and the SUBs
        except TimeoutError:
            self._discard(wire)
            raise SeamLinkError(f"{self.name}: no NATS handshake from {a.host}:{a.port} within "
                                f"{self.connect_timeout_s:.1f} s") from None
        except OSError as exc:
            self._discard(wire)
            raise SeamLinkError(f"{self.name}: cannot connect to NATS at {a.host}:{a.port}: {exc}") from None
        except BaseException:
            self._discard(wire)
            raise
        self._wire = wire
        self._outstanding_pings = 0

    @staticmethod
    def _discard(wire: _Wire) -> None:
        if wire.transport is not None:
            wire.transport.abort()

    def after_each_read(self, callback: Callable[[], None]) -> None:
        """Call `callback()` after each socket read that delivered messages, once they all have been:
        a subscriber that queues messages can then act on everything that arrived together."""
        self._read_callbacks.append(callback)

    def _read_done(self) -> None:
        self._call_all(self._read_callbacks, "after-read callback")

    def _call_all(self, callbacks: list[Callable[[], None]], what: str) -> None:
        """Call each; one that fails is logged, and neither the reader nor the reconnect stops for it."""
        for callback in list(callbacks):
            try:
                callback()
            except Exception:
                log.exception("%s: %s failed", self.name, what)

    def on_disconnect(self, listener: Callable[[], None]) -> None:
        """Call `listener()` whenever the connection drops (not on close): whoever waits for a message
        that may have been lost with it can stop waiting now."""
        self._disconnect_listeners.append(listener)

    def _update_info(self, info: dict[str, Any]) -> None:
        payload = info.get("max_payload")
        if isinstance(payload, int) and payload > 0:
            self.max_payload = payload

    def _connection_lost(self, wire: _Wire, exc: Exception | None) -> None:
        if wire is not self._wire:
            return  # a handshake that failed, or an old connection
        self._wire = None
        if self._closed:
            log.info("%s: seam link closed", self.name)
            return
        log.warning("%s: seam link disconnected from NATS%s", self.name, f": {exc}" if exc else "")
        self._call_all(self._disconnect_listeners, "disconnect listener")
        self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect(),
                                                                      name=f"seam-reconnect-{self.name}")

    async def _reconnect(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.reconnect_wait_s)
            if self._closed:
                return
            try:
                await self._open()
            except SeamLinkError as exc:
                log.debug("%s: seam link reconnect failed: %s", self.name, exc)
                continue
            self.reconnects += 1
            log.info("%s: seam link reconnected to NATS at %s:%d", self.name, self.address.host, self.address.port)
            return

    async def _ping_loop(self) -> None:
        """Keepalive: a connection whose pings go unanswered is dropped (and so reconnected)."""
        while not self._closed:
            await asyncio.sleep(self.ping_interval_s)
            wire = self._wire
            if wire is None or not self.is_connected:
                continue
            if self._outstanding_pings >= self.max_outstanding_pings:
                log.warning("%s: %d pings unanswered: dropping the seam link's connection", self.name,
                            self._outstanding_pings)
                self._discard(wire)
                continue
            self._outstanding_pings += 1
            wire.write(b"PING\r\n")

    def _pong(self) -> None:
        self._outstanding_pings = 0

    # -- messages -------------------------------------------------------------------------------

    @staticmethod
    def _sub_line(sid: int, subject: str, queue: str) -> bytes:
        return f"SUB {subject} {queue} {sid}\r\n".encode() if queue else f"SUB {subject} {sid}\r\n".encode()

    def subscribe(self, subject: str, handler: Handler, queue: str = "") -> int:
        """Deliver every message on `subject` to `handler(subject, payload)`, called inside the socket
        read: it must not block (hand work to a task or a future). Returns the subscription id."""
        if not subject or any(c.isspace() for c in subject) or any(c.isspace() for c in queue):
            raise SeamLinkError(f"bad subject or queue group: {subject!r} {queue!r}")
        sid = self._next_sid
        self._next_sid += 1
        self._subs[sid] = (subject, queue, handler)
        if self._wire is not None:
            self._wire.write(self._sub_line(sid, subject, queue))
        return sid

    def unsubscribe(self, sid: int) -> None:
        if self._subs.pop(sid, None) is not None and self._wire is not None:
            self._wire.write(f"UNSUB {sid}\r\n".encode())

    def publish(self, subject: str, payload: bytes | bytearray) -> None:
        """Write one message to the socket now (the kernel has it when this returns, unless the socket
        is backed up, when asyncio buffers it). Raises `SeamLinkError` when not connected, for a payload
        over the server's max_payload, or when the socket has been backed up past 64 MiB."""
        wire = self._wire
        if wire is None or wire.transport is None or wire.transport.is_closing():
            raise SeamLinkError(f"{self.name}: seam link not connected to NATS (publishing to {subject})")
        if len(payload) > self.max_payload:
            raise SeamLinkError(f"{len(payload)} B message on {subject} is over the server's max_payload "
                                f"({self.max_payload} B)")
        if wire.transport.get_write_buffer_size() > MAX_WRITE_BUFFER_BYTES:
            raise SeamLinkError(f"{self.name}: the connection to NATS is backed up (publishing to {subject})")
        wire.transport.write(b"".join((f"PUB {subject} {len(payload)}\r\n".encode(), payload, b"\r\n")))

    def _deliver(self, sid: int, subject: str, payload: bytearray) -> None:
        sub = self._subs.get(sid)
        if sub is None:
            return  # unsubscribed while the message was on its way
        try:
            sub[2](subject, payload)
        except Exception:  # a failing handler must not take the connection's reader down
            log.exception("%s: seam handler for %s failed", self.name, subject)

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until the server has processed everything written so far (a PING's PONG)."""
        wire = self._wire
        if wire is None:
            raise SeamLinkError(f"{self.name}: seam link not connected to NATS")
        try:
            async with asyncio.timeout(timeout_s):
                await wire.ping()
        except TimeoutError:
            raise SeamLinkError(f"{self.name}: NATS did not answer a PING within {timeout_s:.1f} s") from None

    async def close(self) -> None:
        """Flush what was written (briefly), then close; no reconnect after this."""
        if self._closed:
            return
        if self._wire is not None:
            with contextlib.suppress(SeamLinkError):
                await self.flush(timeout_s=1.0)
        self._closed = True
        for task in (self._ping_task, self._reconnect_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        wire = self._wire
        if wire is not None and wire.transport is not None:
            wire.transport.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(wire.lost), 1.0)

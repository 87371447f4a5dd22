"""The lean seam link (shared/seam_link.py) on a real nats-server, and its parser on its own.

It speaks the NATS client protocol itself, so these check what nats-py would otherwise guarantee:
messages arrive whole and in order whatever the socket's chunking, it interoperates with nats-py
both ways, it honours the server's max_payload, it reconnects (and re-subscribes) after the server
restarts, and every failure is a `SeamLinkError` that says what went wrong.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import nats
import pytest

from shared.nats_server import EmbeddedNatsServer, free_port
from shared.seam_link import SeamLink, SeamLinkError, ServerAddress, _Wire

SUBJECT = "aflex.v1.test.seam"


class _Inbox:
    """Collects (subject, payload) deliveries; `wait(n)` until n have arrived."""

    def __init__(self) -> None:
        self.items: list[tuple[str, bytearray]] = []
        self._changed = asyncio.Event()

    def __call__(self, subject: str, payload: bytearray) -> None:
        self.items.append((subject, payload))
        self._changed.set()

    async def wait(self, count: int, timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while len(self.items) < count:
                self._changed.clear()
                await self._changed.wait()


def _run(coro_fn: Callable[[], Any]) -> Any:
    return asyncio.run(coro_fn())


def test_messages_arrive_whole_and_in_order(nats_url: str) -> None:
    payloads = [os.urandom(n) for n in (0, 1, 2, 13, 36_864, 1_000_000)] + [str(i).encode() * 50 for i in range(500)]

    async def main() -> None:
        sender = await SeamLink.connect(nats_url, "sender")
        receiver = await SeamLink.connect(nats_url, "receiver")
        inbox = _Inbox()
        receiver.subscribe(SUBJECT, inbox)
        await receiver.flush()
        for payload in payloads:
            sender.publish(SUBJECT, payload)
        await inbox.wait(len(payloads))
        assert [bytes(p) for _, p in inbox.items] == payloads
        assert all(subject == SUBJECT and isinstance(p, bytearray) for subject, p in inbox.items)
        await sender.close()
        await receiver.close()

    _run(main)


def test_interoperates_with_nats_py_both_ways(nats_url: str) -> None:
    async def main() -> None:
        link = await SeamLink.connect(nats_url, "lean")
        nc = await nats.connect(nats_url)
        try:
            inbox = _Inbox()
            link.subscribe(f"{SUBJECT}.to_lean", inbox)
            await link.flush()
            got: asyncio.Queue[bytes] = asyncio.Queue()

            async def on_msg(msg: Any) -> None:
                await got.put(msg.data)

            await nc.subscribe(f"{SUBJECT}.to_nats_py", cb=on_msg)
            await nc.flush()
            await nc.publish(f"{SUBJECT}.to_lean", b"from nats-py")
            link.publish(f"{SUBJECT}.to_nats_py", b"from the seam link")
            await inbox.wait(1)
            assert inbox.items == [(f"{SUBJECT}.to_lean", bytearray(b"from nats-py"))]
            assert await asyncio.wait_for(got.get(), 10) == b"from the seam link"
        finally:
            await nc.close()
            await link.close()

    _run(main)


def test_queue_groups_share_and_unsubscribe_stops(nats_url: str) -> None:
    async def main() -> None:
        sender = await SeamLink.connect(nats_url, "sender")
        a, b = _Inbox(), _Inbox()
        receiver = await SeamLink.connect(nats_url, "receiver")
        sid_a = receiver.subscribe(SUBJECT, a, queue="workers")
        receiver.subscribe(SUBJECT, b, queue="workers")
        await receiver.flush()
        for i in range(40):
            sender.publish(SUBJECT, str(i).encode())
        await sender.flush()
        async with asyncio.timeout(10):
            while len(a.items) + len(b.items) < 40:
                await asyncio.sleep(0.01)
        assert len(a.items) + len(b.items) == 40  # each message to one member of the group
        receiver.unsubscribe(sid_a)
        await receiver.flush()
        before = len(a.items)
        for _ in range(10):
            sender.publish(SUBJECT, b"after")
        await b.wait(len(b.items) + 10)
        assert len(a.items) == before
        await sender.close()
        await receiver.close()

    _run(main)


def test_max_payload_is_the_servers_and_is_enforced(nats_url: str) -> None:
    async def main() -> None:
        link = await SeamLink.connect(nats_url, "big")
        try:
            assert link.max_payload == 8 * 1024 * 1024  # what the embedded nats.conf sets
            with pytest.raises(SeamLinkError, match="over the server's max_payload"):
                link.publish(SUBJECT, bytes(link.max_payload + 1))
            assert link.is_connected  # refused here, not by the server
        finally:
            await link.close()

    _run(main)


def test_a_failing_handler_does_not_stop_delivery(nats_url: str) -> None:
    async def main() -> None:
        link = await SeamLink.connect(nats_url, "handler")
        inbox = _Inbox()

        def handler(subject: str, payload: bytearray) -> None:
            inbox(subject, payload)
            if payload == b"boom":
                raise RuntimeError("handler bug")

        link.subscribe(SUBJECT, handler)
        await link.flush()
        link.publish(SUBJECT, b"boom")
        link.publish(SUBJECT, b"still here")
        await inbox.wait(2)
        assert [bytes(p) for _, p in inbox.items] == [b"boom", b"still here"]
        await link.close()

    _run(main)


def test_reconnects_and_resubscribes_after_a_server_restart() -> None:
    port = free_port()

    async def main() -> None:
        server = EmbeddedNatsServer(port=port).start()
        link = await SeamLink.connect(server.url, "survivor", reconnect_wait_s=0.1)
        inbox = _Inbox()
        link.subscribe(SUBJECT, inbox)
        await link.flush()
        try:
            server.stop()
            async with asyncio.timeout(10):
                while link.is_connected:
                    await asyncio.sleep(0.02)
            with pytest.raises(SeamLinkError, match="not connected"):
                link.publish(SUBJECT, b"lost")
            server = EmbeddedNatsServer(port=port).start()
            async with asyncio.timeout(15):
                while not link.is_connected:
                    await asyncio.sleep(0.05)
            assert link.reconnects == 1
            other = await nats.connect(server.url)
            await other.publish(SUBJECT, b"after the restart")  # reaches the re-sent SUB
            await other.close()
            await inbox.wait(1)
            assert bytes(inbox.items[0][1]) == b"after the restart"
        finally:
            await link.close()
            server.stop()

    _run(main)


def test_nothing_listening_is_a_clear_error_not_a_hang() -> None:
    async def main() -> None:
        with pytest.raises(SeamLinkError, match="cannot connect to NATS"):
            await SeamLink.connect(f"nats://127.0.0.1:{free_port()}", "nobody", connect_timeout_s=2.0)

    _run(main)


@pytest.mark.parametrize(("url", "message"), [
    ("tls://127.0.0.1:4222", "AFLEX_SEAM_TRANSPORT=nats-py"),
    ("http://127.0.0.1:4222", "not a NATS URL"),
    ("nats://:4222", "no host"),
    ("nats://127.0.0.1:port", "bad port"),
])
def test_urls_it_cannot_use_are_refused_with_a_reason(url: str, message: str) -> None:
    with pytest.raises(SeamLinkError, match=message):
        ServerAddress.parse(url)


def test_url_credentials() -> None:
    assert ServerAddress.parse("nats://s3cr3t@example:4333") == ServerAddress("example", 4333, token="s3cr3t")
    assert ServerAddress.parse("nats://me:p%40ss@example") == ServerAddress("example", 4222, "me", "p@ss")
    assert ServerAddress.parse("localhost:5000") == ServerAddress("localhost", 5000)


class _FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return False


def test_parser_handles_any_chunking() -> None:
    """The byte stream of INFO, PING, MSGs (with and without reply subjects, empty and CRLF-bearing
    payloads) and -ERR, fed one byte at a time and in uneven chunks, gives the same deliveries."""
    messages = [(b"a.b", 1, b"", b"hello"), (b"a.b", 1, b"_INBOX.x", b""), (b"c", 2, b"", b"line\r\nbreak\r\n"),
                (b"a.b", 1, b"", os.urandom(3000))]
    stream = b'INFO {"max_payload": 4096}\r\nPING\r\n'
    for subject, sid, reply, payload in messages:
        reply_part = b" " + reply if reply else b""
        stream += b"MSG %s %d%s %d\r\n%s\r\n" % (subject, sid, reply_part, len(payload), payload)
    stream += b"+OK\r\n-ERR 'Unknown Protocol Operation'\r\n"

    async def main() -> None:
        for chunk_size in (1, 2, 7, 64, 1000, len(stream)):
            got, written, wire = _parse(stream, chunk_size)
            assert got == [(sid, subject.decode(), payload) for subject, sid, _, payload in messages], chunk_size
            assert written == [b"PONG\r\n"]  # the server's PING answered
            assert wire.info.done() and wire.info.result() == {"max_payload": 4096}
            assert not wire.buffer

    _run(main)


def _offline_link() -> SeamLink:
    """A link that never connects: its parser is fed by hand."""
    return SeamLink(ServerAddress("127.0.0.1", 4222), "offline", connect_timeout_s=1, reconnect_wait_s=1,
                    ping_interval_s=60, max_outstanding_pings=2)


def _parse(stream: bytes, chunk_size: int) -> tuple[list[tuple[int, str, bytes]], list[bytes], _Wire]:
    """Feed `stream` to a link's parser in chunks; returns (deliveries as (sid, subject, payload), writes, wire)."""
    link = _offline_link()
    got: list[tuple[int, str, bytes]] = []
    link._subs = {1: ("a.b", "", lambda s, p: got.append((1, s, bytes(p)))),
                  2: ("c", "", lambda s, p: got.append((2, s, bytes(p))))}
    wire = _Wire(link)
    transport = _FakeTransport()
    wire.transport = transport  # type: ignore[assignment]
    for start in range(0, len(stream), chunk_size):
        wire.data_received(stream[start:start + chunk_size])
    return got, transport.written, wire


def test_after_each_read_runs_once_per_read_after_its_messages() -> None:
    """A subscriber that queues messages acts on everything one read brought: the callback runs after
    all of that read's deliveries, and not for a read that completed no message."""
    msg = b"MSG a.b 1 5\r\nhello\r\n"

    async def main() -> None:
        link = _offline_link()
        delivered: list[bytes] = []
        seen_at_callback: list[int] = []
        link._subs = {1: ("a.b", "", lambda s, p: delivered.append(bytes(p)))}
        link.after_each_read(lambda: seen_at_callback.append(len(delivered)))
        wire = _Wire(link)
        wire.transport = _FakeTransport()  # type: ignore[assignment]
        wire.data_received(msg * 3)  # three messages in one read
        wire.data_received(msg[:10])  # half a message: nothing delivered, no callback
        wire.data_received(msg[10:] + b"PING\r\n")
        assert delivered == [b"hello"] * 4
        assert seen_at_callback == [3, 4]

    _run(main)

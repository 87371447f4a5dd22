"""`bus.publish_now` on a real nats-server: the bytes leave before the publisher's loop runs again."""

from __future__ import annotations

import asyncio
import threading

from shared import bus

SUBJECT = "test.bus.now"


class _Listener:
    """A subscriber on its own thread and loop, so it keeps receiving while the test's loop is blocked."""

    def __init__(self, url: str, expect: int) -> None:
        self.url, self.expect = url, expect
        self.got: list[bytes] = []
        self.ready, self.complete, self.stop = threading.Event(), threading.Event(), threading.Event()
        self.thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)

    async def _main(self) -> None:
        nc = await bus.connect(self.url, name="test-listener")

        async def on_msg(msg: object) -> None:
            self.got.append(msg.data)  # type: ignore[attr-defined]
            if len(self.got) >= self.expect:
                self.complete.set()

        await nc.subscribe(SUBJECT, cb=on_msg)
        await nc.flush()
        self.ready.set()
        while not self.stop.is_set():
            await asyncio.sleep(0.01)
        await nc.close()

    def __enter__(self) -> _Listener:
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def test_publish_now_writes_before_the_loop_runs_again_and_keeps_order(nats_url: str) -> None:
    payloads = [b"queued-first", b"now-1", b"x" * 40_000, b"now-3"]

    async def body() -> None:
        nc = await bus.connect(nats_url, name="test-publisher")
        try:
            with _Listener(nats_url, len(payloads)) as listener:
                await nc.publish(SUBJECT, payloads[0])  # plain publish: left for nats-py's flusher
                for payload in payloads[1:]:
                    await bus.publish_now(nc, SUBJECT, payload)
                assert nc._pending_data_size == 0  # nothing left for the flusher
                # Block this loop: the flusher cannot run, so whatever arrives was written by publish_now.
                assert listener.complete.wait(5), f"got {len(listener.got)} of {len(payloads)} while blocked"
                assert listener.got == payloads
        finally:
            await bus.close(nc)

    asyncio.run(asyncio.wait_for(body(), 30))


def test_publish_now_while_disconnected_leaves_the_message_queued(nats_url: str) -> None:
    async def body() -> None:
        nc = await bus.connect(nats_url, name="test-publisher", pending_size=1 << 20)
        try:
            nc._status = nc.RECONNECTING  # as nats-py marks a lost connection
            await bus.publish_now(nc, SUBJECT, b"later")
            assert nc._pending_data_size > 0  # buffered for after the reconnect, as `publish` leaves it
            nc._status = nc.CONNECTED
        finally:
            await bus.close(nc)

    asyncio.run(asyncio.wait_for(body(), 30))

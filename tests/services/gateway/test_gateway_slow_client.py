"""A client that stops reading its stream holds up nobody else.

One client sends a streaming request whose answer is far larger than the socket buffers (10,000
deltas) and never reads a byte of it; while it hangs there, other clients' requests are served
whole through the official openai client.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator

import pytest

from shared import subjects
from shared.messages import OutputDelta, SubmitRequest, encode
from tests.services.gateway.test_gateway import MESSAGES, MODEL, TEXT, FakeScheduler, Harness

LONG = 10_000


class FloodingScheduler(FakeScheduler):
    """Answers a request whose max_tokens is LONG with LONG deltas, as fast as it can publish them."""

    async def _generate(self, req: SubmitRequest) -> None:
        if req.sampling.max_tokens != LONG:
            await super()._generate(req)
            return
        out = subjects.req_out(req.request_id)
        for index in range(LONG):
            await self.nc.publish(out, encode(OutputDelta(request_id=req.request_id, index=index,
                                                          token_ids=[self.script[index % (len(self.script) - 1)]])))
            if index % 500 == 0:
                await asyncio.sleep(0)


@pytest.fixture(scope="module")
def h() -> Iterator[Harness]:
    harness = Harness(FloodingScheduler, request_timeout_s=30.0)
    try:
        yield harness
    finally:
        harness.close()


def test_a_client_that_stops_reading_does_not_block_the_others(h: Harness) -> None:
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "stream": True, "max_tokens": LONG,
                       "ignore_eos": True}).encode()
    stalled = socket.create_connection(("127.0.0.1", h.port))
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        # ... and never reads: its deltas back up into the gateway's send buffer
        for _ in range(5):
            response = h.client.chat.completions.create(model=MODEL, messages=MESSAGES)
            assert response.choices[0].message.content == TEXT
        stream = h.client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == TEXT
    finally:
        stalled.close()

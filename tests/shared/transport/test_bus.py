"""The bus client takes a server list (a NATS cluster's nodes, comma-separated) and uses whichever answers."""

from __future__ import annotations

import asyncio

from shared.transport import bus
from shared.transport.nats_server import EmbeddedNatsServer, free_port


def test_a_comma_separated_server_list_connects_past_a_dead_node() -> None:
    dead = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    with EmbeddedNatsServer() as live:
        assert bus.server_list(f"{dead}, {live.url}") == [dead, live.url]

        async def run() -> str:
            nc = await bus.connect(f"{dead},{live.url}", "bus-test", connect_timeout_s=1.0)
            try:
                assert nc.connected_url is not None
                return f"nats://{nc.connected_url.netloc}"
            finally:
                await bus.close(nc)

        assert asyncio.run(run()) == live.url

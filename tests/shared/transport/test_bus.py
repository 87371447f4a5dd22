"""The bus client takes a server list (a NATS cluster's nodes, comma-separated) and uses whichever answers."""

from __future__ import annotations

import asyncio
import contextlib
import time

from nats.aio.msg import Msg

from shared import subjects
from shared.transport import bus, nats_auth
from shared.transport.nats_server import EmbeddedNatsCluster, EmbeddedNatsServer, free_port


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


def test_credentials_in_the_url_reach_the_servers_a_cluster_tells_of() -> None:
    """A subscriber given one node's URL with its user in it (`aflex up`'s telemetry URL, say) learns the
    other nodes from the cluster; when its node dies it must log in to those too (nats-py would send the
    URL's credentials only to the URL's own server: `Authorization Violation` elsewhere, found by the fault
    campaign's watcher)."""
    passwords = nats_auth.new_credentials()
    with EmbeddedNatsCluster(3, users=passwords) as cluster:
        first = cluster.nodes[0]

        async def run() -> bytes:
            listener = await bus.connect(nats_auth.url_for(first.url, "telemetry", passwords["telemetry"]),
                                         "bus-test-telemetry", reconnect_wait_s=0.1)
            heard: asyncio.Queue[bytes] = asyncio.Queue()

            async def on_message(msg: Msg) -> None:
                await heard.put(msg.data)

            await listener.subscribe(f"{subjects.PREFIX}.telemetry.scheduler.x", cb=on_message)
            await listener.flush()
            first.stop()  # its node dies: it goes on to one the cluster told it of
            talker = await bus.connect(cluster.nodes[1].url, "bus-test-scheduler", user="scheduler",
                                       password=passwords["scheduler"])
            try:
                deadline = time.monotonic() + 10
                while True:  # until it is subscribed again over there
                    await talker.publish(f"{subjects.PREFIX}.telemetry.scheduler.x", b"heard")
                    with contextlib.suppress(TimeoutError):
                        return await asyncio.wait_for(heard.get(), 0.2)
                    assert time.monotonic() < deadline, "the listener never logged in to another node"
            finally:
                await bus.close(talker)
                await bus.close(listener)

        assert asyncio.run(run()) == b"heard"

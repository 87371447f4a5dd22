"""Per-role NATS users on `aflex up`'s embedded server: nobody but the scheduler sets a GPU clock.

The mesh runs with a user per role (passwords made at start). The read-only `telemetry` user that
`aflex up` prints can read telemetry; its frequency command is refused by the server and no clock
changes; the same command from the scheduler's user is applied (so the check can fail); and a client
without credentials is not let in.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import nats.errors
import pytest

from shared import subjects
from shared.gpu.emulated import read_locked_mhz
from shared.messages import FrequencyCommand, WorkerTelemetry, decode, encode
from tests.test_mesh_faults import _child
from tools.launch import Mesh, aflex_up

REFUSED_MHZ = 810  # supported clocks of the emulated a800, both well below its default (max)
APPLIED_MHZ = 900
WAIT_S = 30.0


def command(clock_mhz: int) -> bytes:
    now = time.time()
    return encode(FrequencyCommand(worker_id="attn-0", clocks_mhz={"prefill": clock_mhz, "decode": clock_mhz},
                                   valid_until_ts=now + 120, issued_ts=now, reason="test"))


@pytest.fixture(scope="module")
def mesh(tiny_chat_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mesh, Path]]:
    state = tmp_path_factory.mktemp("gpus")
    env = {"AFLEX_GPU_BACKEND": "emulated", "AFLEX_GPU_STATE_DIR": str(state), "AFLEX_FREQ_WINDOW_S": "0"}
    with aflex_up(str(tiny_chat_checkpoint), env_extra=env) as running:
        yield running, state / "attn-0.json"


def test_the_telemetry_user_reads_telemetry_but_cannot_set_a_clock(mesh: tuple[Mesh, Path]) -> None:
    running, device_file = mesh
    assert "nats://telemetry:" in running.telemetry_url

    async def run() -> tuple[list[Exception], list[WorkerTelemetry]]:
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        nc = await nats.connect(running.telemetry_url, error_cb=on_error)
        seen: asyncio.Queue[WorkerTelemetry] = asyncio.Queue()

        async def on_telemetry(msg: nats.aio.msg.Msg) -> None:
            if msg.subject == subjects.telemetry("attention", "attn-0"):
                seen.put_nowait(decode(WorkerTelemetry, msg.data))

        await nc.subscribe(subjects.TELEMETRY_ALL, cb=on_telemetry)
        await asyncio.wait_for(seen.get(), WAIT_S)  # reading is allowed
        await nc.publish(subjects.freq("attn-0"), command(REFUSED_MHZ))
        await nc.flush()
        deadline = time.monotonic() + WAIT_S
        while not any("permissions violation" in str(e) for e in errors):
            assert time.monotonic() < deadline, "the server did not refuse the publish"
            await asyncio.sleep(0.02)
        after = [await asyncio.wait_for(seen.get(), WAIT_S) for _ in range(5)]  # half a second of telemetry
        await nc.close()
        return errors, after

    errors, after = asyncio.run(run())
    assert any(f'publish to "{subjects.freq("attn-0")}"' in str(e) for e in errors)
    assert all(t.target_clock_mhz != REFUSED_MHZ and t.clock_mhz != REFUSED_MHZ for t in after)
    assert read_locked_mhz(device_file) != REFUSED_MHZ


def test_the_schedulers_user_does_set_it(mesh: tuple[Mesh, Path]) -> None:
    running, device_file = mesh
    _, _, env = _child(running, "scheduler")

    async def run() -> None:
        nc = await nats.connect(f"nats://127.0.0.1:{running.nats_port}", user=env["AFLEX_NATS_USER"],
                                password=env["AFLEX_NATS_PASSWORD"])
        await nc.publish(subjects.freq("attn-0"), command(APPLIED_MHZ))
        await nc.flush()
        await nc.close()

    asyncio.run(run())
    deadline = time.monotonic() + WAIT_S
    while read_locked_mhz(device_file) != APPLIED_MHZ:
        assert time.monotonic() < deadline, "the scheduler's command was not applied"
        time.sleep(0.05)


def test_a_client_without_credentials_is_not_let_in(mesh: tuple[Mesh, Path]) -> None:
    running, _ = mesh

    async def run() -> None:
        await nats.connect(f"nats://127.0.0.1:{running.nats_port}", allow_reconnect=False, connect_timeout=5)

    with pytest.raises((nats.errors.Error, OSError)):
        asyncio.run(run())

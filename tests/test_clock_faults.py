"""Clocks always come back: a worker killed at a low clock, a lock left from before, or a lost NATS
never leave a GPU slow.

The workers run the emulated GPU with a device file (`gpu_state_dir`), so a locked clock outlives
the process that set it, as on a real GPU. The scheduler's own commands are off (`freq_window_s` 0):
the test commands a clock as the scheduler would, on `freq.<wid>`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from shared import subjects
from shared.gpu.emulated import read_locked_mhz, write_locked_mhz
from shared.messages import FrequencyCommand, encode
from shared.transport import bus
from shared.transport.nats_server import EmbeddedNatsServer, free_port
from tools.launch import Mesh, aflex_up

LOW_MHZ = 810  # a supported clock of the a800 profile, well below its default (max) clock
STALE_MHZ = 705


def wait_for(condition: Callable[[], bool], what: str, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def command(nats_url: str, worker_id: str, clock_mhz: int, valid_s: float) -> None:
    async def send() -> None:
        nc = await bus.connect(nats_url, "test-as-scheduler")
        now = time.time()
        cmd = FrequencyCommand(worker_id=worker_id, clocks_mhz={"prefill": clock_mhz, "decode": clock_mhz},
                               valid_until_ts=now + valid_s, issued_ts=now, reason="test")
        await nc.publish(subjects.freq(worker_id), encode(cmd))
        await bus.close(nc)

    asyncio.run(send())


def settings(state: Path) -> dict[str, str]:
    return {"AFLEX_GPU_BACKEND": "emulated", "AFLEX_GPU_STATE_DIR": str(state), "AFLEX_FREQ_WINDOW_S": "0"}


def test_a_stale_lock_is_reset_at_start_and_a_killed_workers_lock_is_reset(tiny_chat_checkpoint: Path,
                                                                            tmp_path: Path) -> None:
    state = tmp_path / "gpus"
    ffn = state / "ffn-0.json"
    write_locked_mhz(ffn, STALE_MHZ)  # what a worker killed before this mesh left behind
    port = free_port()
    server = EmbeddedNatsServer(port=port).start()
    try:
        with aflex_up(str(tiny_chat_checkpoint), nats_url=server.url, env_extra=settings(state)) as mesh:
            assert read_locked_mhz(ffn) is None  # the worker reset it as it started
            command(server.url, "ffn-0", LOW_MHZ, valid_s=120)
            wait_for(lambda: read_locked_mhz(ffn) == LOW_MHZ, "the commanded clock was never set")
            pid = mesh.pid_of("ffn-0")
            os.kill(pid, signal.SIGKILL)  # no chance to reset it itself
            wait_for(lambda: "reset the emulated GPU clock of ffn-0" in mesh.output(), "aflex up did not reset it")
            try:
                wait_for(lambda: _started_again(mesh, pid), "ffn-0 was not started again")
            except AssertionError as exc:  # say why: what aflex up printed
                raise AssertionError(f"{exc}\n{mesh.output()[-4000:]}") from None
            assert read_locked_mhz(ffn) != LOW_MHZ
    finally:
        server.stop()


def test_commands_expire_when_nats_is_lost(tiny_chat_checkpoint: Path, tmp_path: Path) -> None:
    state = tmp_path / "gpus"
    attn = state / "attn-0.json"
    port = free_port()
    server = EmbeddedNatsServer(port=port).start()
    try:
        with aflex_up(str(tiny_chat_checkpoint), nats_url=server.url, env_extra=settings(state)):
            command(server.url, "attn-0", LOW_MHZ, valid_s=2.0)
            wait_for(lambda: read_locked_mhz(attn) == LOW_MHZ, "the commanded clock was never set")
            server.stop()  # no scheduler can renew the command now
            wait_for(lambda: read_locked_mhz(attn) != LOW_MHZ, "the expired command kept the GPU slow")
            server = EmbeddedNatsServer(port=port).start()  # let the mesh stop cleanly
    finally:
        server.stop()


def _started_again(mesh: Mesh, old_pid: int) -> bool:
    try:
        return mesh.pid_of("ffn-0") != old_pid
    except LookupError:  # between the old process and the new one
        return False

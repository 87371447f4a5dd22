"""The global scheduler on a real mesh (issue 26): `aflex up` with 2 attention and 2 FFN workers and a
one-second provisioning window. The tiny model's load fits one attention and one FFN worker, so the
plan parks the others, warm (their emulated GPUs at the lowest clock, drawing the simulator's
warm-parked power) or cold (weights released, bare idle), and every stream is served by the two left;
when the serving attention worker hangs mid-stream (SIGSTOP: it stops heartbeating, and no restart can
bring it back before the scheduler finds it lost, as one after a SIGKILL may), the scheduler plans
again at once, the parked one wakes (a cold one loads its weights again), and every stream completes
with the text it gets when nothing fails.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.test_mesh_faults import _child_pid, _run
from tools.launch import Mesh, aflex_up


def _wait_log(mesh: Mesh, pattern: str, deadline_s: float = 60.0, since: int = 0) -> re.Match[str]:
    """The first match of `pattern` in the mesh's output (from character `since` on), waiting for it."""
    deadline = time.monotonic() + deadline_s
    while True:
        found = re.search(pattern, mesh.output()[since:])
        if found:
            return found
        assert time.monotonic() < deadline, f"{pattern!r} not in the log:\n{mesh.output()[-3000:]}"
        time.sleep(0.2)


@pytest.mark.parametrize("parking", ["warm", "cold"])
def test_the_plan_parks_what_the_load_does_not_need_and_a_loss_wakes_it(tiny_chat_checkpoint: Path,
                                                                        parking: str) -> None:
    """Warm: the parked workers keep their weights, their GPUs locked at the lowest clock. Cold: they
    release their weights once drained, their GPUs at bare idle, and load them again when woken."""
    from shared.gpu.emulated import load_profile

    profile = load_profile("a800")
    parked_w = profile.warm_parked_power_w if parking == "warm" else profile.idle_power_w
    with aflex_up(str(tiny_chat_checkpoint), "--attention-workers", "2", "--ffn-workers", "2",
                  "--provision-window-s", "1", "--provision-parking", parking, "--gpu-profile", "a800",
                  open_nats=True) as mesh:
        # which of the two parks depends on the order they registered in: the first plan keeps the one it saw
        parked_a = _wait_log(mesh, rf"(attn-\d): parked-{parking}").group(1)  # the worker heard its assignment
        parked_f = _wait_log(mesh, rf"(ffn-\d): parked-{parking}").group(1)
        serving_a, serving_f = ({"attn-0", "attn-1"} - {parked_a}).pop(), ({"ffn-0", "ffn-1"} - {parked_f}).pop()
        if parking == "cold":
            _wait_log(mesh, rf"{parked_a}: parked cold: weights released")
            _wait_log(mesh, rf"{parked_f}: parked cold: weights released")
        # the parked states are what the simulator charges (`fleet.py`'s parked groups): warm, the emulated
        # GPU locked at the lowest clock draws the profile's warm-parked power; cold, its bare idle power
        readings = asyncio.run(_telemetry_of(mesh, parked_a, seconds=2.0))
        parked = [r for r in readings if r["assignment"] == f"parked-{parking}" and r["clock_mhz"] == 210]
        assert parked, readings[-3:]
        assert all(abs(float(r["power_w"]) - parked_w) < 1e-6 for r in parked[-3:]), parked[-3:]  # type: ignore[arg-type]
        parked_line = f'aflex_worker_assignment{{assignment="parked-{parking}",worker="{parked_a}"}} 1.0'
        deadline = time.monotonic() + 30
        while parked_line not in (text := httpx.get(f"{mesh.base_url.removesuffix('/v1')}/metrics").text):
            assert time.monotonic() < deadline, [x for x in text.splitlines() if "plan" in x or "assign" in x]
            time.sleep(0.2)
        baseline = asyncio.run(_run(mesh))
        log = mesh.output()
        assert f"{serving_a}: mixed-attention" in log and f"{serving_f}: ffn" in log
        hung = _child_pid(mesh, serving_a)
        try:
            after_loss = asyncio.run(_run(mesh, fault=lambda: os.kill(hung, signal.SIGSTOP)))
        finally:
            os.kill(hung, signal.SIGCONT)
        _wait_log(mesh, rf"worker {serving_a} \(attention\) missed heartbeats")
        _wait_log(mesh, rf"plan \d+ \(mixed, [0-9.]+ req/s planned\): .*{parked_a} -> mixed-attention")
        if parking == "cold":  # it served the recomputed sequences with its weights loaded again
            _wait_log(mesh, rf"{parked_a}: weights loaded again in [0-9.]+ s")
            # the scheduler SIGKILLed while a worker is parked cold: the new run holds no plan, so every worker
            # serves until its first one, and a worker that released its weights loads them before it computes
            mark = len(mesh.output())
            _wait_log(mesh, r"attn-\d: parked-cold", since=mark)  # the hung one is back, and one of the two parks
            after_scheduler = asyncio.run(_run(mesh, kill="scheduler"))
            _wait_log(mesh, r"scheduler exited with status -9")
            assert after_scheduler == baseline
    assert [tokens for _, tokens in after_loss] == [tokens for _, tokens in baseline]
    assert after_loss == baseline


async def _telemetry_of(mesh: Mesh, worker_id: str, seconds: float) -> list[dict[str, object]]:
    from shared import subjects
    from shared.messages import WorkerTelemetry, decode
    from shared.transport import bus

    nc = await bus.connect(f"nats://127.0.0.1:{mesh.nats_port}", "test-telemetry")
    got: list[dict[str, object]] = []

    async def cb(msg: object) -> None:
        t = decode(WorkerTelemetry, msg.data)  # type: ignore[attr-defined]
        got.append({"assignment": t.assignment, "clock_mhz": t.clock_mhz, "power_w": t.power_w})

    await nc.subscribe(subjects.telemetry("attention", worker_id), cb=cb)
    await asyncio.sleep(seconds)
    await nc.close()
    assert _child_pid(mesh, worker_id) > 0
    return got

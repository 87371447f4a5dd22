"""P/D pools on a real mesh (issue 26): `aflex up` with 2 attention and 2 FFN workers and
`--provision-kinds pd`. The plan names a prefill and a decode attention worker, each with an FFN
worker of its own; every request is prefilled on the first, its KV moves to the second over
torch.distributed (the descriptor and the acknowledgement on NATS), and it decodes there. The tokens
are the in-process engine's, greedy and seeded, and /metrics counts the handoffs and their bytes.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import httpx
import openai
from nats.aio.msg import Msg

from shared import subjects
from shared.messages import KVHandoff, decode
from shared.transport import bus
from tests.test_mesh_e2e import ask_greedy_and_seeded, generate
from tests.test_mesh_faults import _child_pid, _run
from tools.launch import Mesh, aflex_up, until_pd_plan

STREAMS = 4  # per fault: their KV moves while the kill lands


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
    assert found, [line for line in text.splitlines() if "handoff" in line]
    return float(found.group(1))


def test_pd_pools_give_the_engines_tokens_and_a_kill_mid_handoff_loses_nothing(tiny_chat_checkpoint: Path) -> None:
    """Exactness: 8 concurrent requests, greedy and seeded, each prefilled on the prefill worker and
    decoded on the decode worker after its KV moved, give `aflex generate`'s text; /metrics counts the
    handoffs and their bytes. Faults: 4 streams (half seeded and sampled) run three times more, each time
    with a SIGKILL the moment the first `KVHandoff` is on the bus, while the sequences' KV moves: of the
    prefill worker (its sequences are recomputed on the other, which the next plan makes a mixed pool), of
    the decode worker (the moves to it fail, or its sequences are recomputed), and of the scheduler
    (mid-change: a new run takes the requests over as continuations). Every stream completes with the
    no-fault text."""
    greedy = generate(tiny_chat_checkpoint, max_tokens=10, temperature=0.0, seed=None)
    seeded = generate(tiny_chat_checkpoint, max_tokens=10, temperature=0.8, seed=7)
    with aflex_up(str(tiny_chat_checkpoint), "--attention-workers", "2", "--ffn-workers", "2",
                  "--provision-window-s", "1", "--provision-kinds", "pd", "--gpu-profile", "a800",
                  open_nats=True) as mesh:
        asyncio.run(until_pd_plan(mesh, deadline_s=90.0))
        texts = ask_greedy_and_seeded(mesh, 8)
        assert texts == [greedy["text"], seeded["text"]] * 4
        metrics_url = f"{mesh.base_url.removesuffix('/v1')}/metrics"
        text = _until_handoffs_counted(metrics_url, 8)
        assert _metric(text, "aflex_kv_handoff_failures_total") == 0
        assert _metric(text, "aflex_kv_handoff_bytes_total") > 0
        assert "KV handoff" not in mesh.output()  # no failure was logged

        baseline = asyncio.run(_run(mesh, sampled=True, count=STREAMS))
        killed: list[str] = []  # which process each role was (the plan may give a restarted worker either role)
        for victim in ("prefill", "decode", "scheduler"):
            asyncio.run(_until_kv_moves(mesh, metrics_url))
            after_fault, process = asyncio.run(_killed_mid_handoff(mesh, victim))
            assert after_fault == baseline, victim
            killed.append(process)
        log = mesh.output()
    assert killed[0].startswith("attn-") and killed[1].startswith("attn-") and killed[2] == "scheduler"
    for process in set(killed):  # each kill landed: once per time that process was the victim
        assert log.count(f"{process} exited with status -9") == killed.count(process), process


def test_pd_pools_of_whole_model_workers_give_the_engines_tokens_and_a_kill_mid_handoff_loses_nothing(
        tiny_chat_checkpoint: Path) -> None:
    """The "pd-colocated" kind (BiScale's and DistServe's instances): `aflex up` with 2 attention workers holding
    both halves, no FFN worker, `--provision-kinds pd-colocated`. The plan names a prefill and a decode
    whole-model worker; each request is prefilled on the first, runs its FFN there, its KV moves to the second,
    and it decodes there. Exactness as above (the engine's tokens, greedy and seeded); then a SIGKILL of the
    prefill worker, and one of the decode worker, each the moment the first `KVHandoff` is on the bus: every
    stream completes with the no-fault text."""
    greedy = generate(tiny_chat_checkpoint, max_tokens=10, temperature=0.0, seed=None)
    seeded = generate(tiny_chat_checkpoint, max_tokens=10, temperature=0.8, seed=7)
    with aflex_up(str(tiny_chat_checkpoint), "--attention-workers", "2", "--provision-window-s", "1",
                  "--provision-kinds", "pd-colocated", "--gpu-profile", "a800", open_nats=True) as mesh:
        plan = asyncio.run(until_pd_plan(mesh, deadline_s=90.0))
        assert plan.kind == "pd-colocated" and set(plan.pools) == {"prefill", "decode"}, plan
        texts = ask_greedy_and_seeded(mesh, 8)
        assert texts == [greedy["text"], seeded["text"]] * 4
        metrics_url = f"{mesh.base_url.removesuffix('/v1')}/metrics"
        text = _until_handoffs_counted(metrics_url, 8)
        assert _metric(text, "aflex_kv_handoff_failures_total") == 0
        assert "[ffn-" not in mesh.output()  # no FFN worker was started: each worker ran the FFN half itself
        assert "2 whole-model workers in P/D pools" in mesh.output()

        baseline = asyncio.run(_run(mesh, sampled=True, count=STREAMS))
        killed: list[str] = []
        for victim in ("prefill", "decode"):
            asyncio.run(_until_kv_moves(mesh, metrics_url))
            after_fault, process = asyncio.run(_killed_mid_handoff(mesh, victim))
            assert after_fault == baseline, victim
            killed.append(process)
        log = mesh.output()
    for process in set(killed):
        assert process.startswith("attn-")
        assert log.count(f"{process} exited with status -9") == killed.count(process), process


def _until_handoffs_counted(metrics_url: str, at_least: int, deadline_s: float = 30.0) -> str:
    """/metrics once it counts `at_least` KV handoffs (the scheduler's counters arrive with its telemetry)."""
    deadline = time.monotonic() + deadline_s
    while _metric(text := httpx.get(metrics_url).text, "aflex_kv_handoffs_total") < at_least:
        assert time.monotonic() < deadline, [line for line in text.splitlines() if "handoff" in line]
        time.sleep(0.2)
    return text


async def _until_kv_moves(mesh: Mesh, metrics_url: str, deadline_s: float = 90.0) -> None:
    """Until a P/D plan stands and a probe request's KV moves: after a kill, the plan may name a decode worker
    that is still restarting, or whose KV seam a failed move has it avoid for `KV_SEAM_AVOID_S`, and then the
    next streams decode where they were prefilled, with no handoff for the fault to land in."""
    await until_pd_plan(mesh, deadline_s=deadline_s)
    client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=60)
    model = (await client.models.list()).data[0].id
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    async with httpx.AsyncClient() as http:
        moved = _metric((await http.get(metrics_url)).text, "aflex_kv_handoffs_total")
        while loop.time() < deadline:
            await client.completions.create(model=model, prompt="probe", max_tokens=4, temperature=0.0)
            for _ in range(10):  # the scheduler's counters reach /metrics with its next telemetry
                if _metric((await http.get(metrics_url)).text, "aflex_kv_handoffs_total") > moved:
                    return
                await asyncio.sleep(0.2)
    raise AssertionError(f"no KV moved within {deadline_s} s of a P/D plan:\n{mesh.output()[-3000:]}")


async def _killed_mid_handoff(mesh: Mesh, victim: str) -> tuple[list[tuple[str, int]], str]:
    """`_run`'s streams, with `victim` ("prefill", "decode" or "scheduler") SIGKILLed at the first handoff;
    and the process that was."""
    nc = await bus.connect(f"nats://127.0.0.1:{mesh.nats_port}", "test-kill")
    killed: list[str] = []

    async def on_handoff(msg: Msg) -> None:
        if killed:
            return
        req = decode(KVHandoff, msg.data)
        process = {"prefill": msg.subject.split(".")[3], "decode": req.to_worker, "scheduler": "scheduler"}[victim]
        os.kill(_child_pid(mesh, process), signal.SIGKILL)
        killed.append(process)

    await nc.subscribe(subjects.attn_kv("*"), cb=on_handoff)
    try:
        results = await _run(mesh, sampled=True, count=STREAMS)
    finally:
        await nc.close()
    assert killed, f"no handoff was seen, so no {victim} was killed"
    return results, killed[0]

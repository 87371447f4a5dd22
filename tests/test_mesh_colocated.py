"""Colocated replicas on a real mesh (issue 26): `aflex up --colocate --provision-kinds colocated` with 2
attention workers and 1 FFN worker; and `aflex up`'s default on a CPU host, the whole model in one worker.
Both attention workers load the FFN half too; the global scheduler's plan runs the whole model on one (or
both) of them and parks the FFN worker. A colocated worker runs each
layer's FFN itself, so the mesh serves with its FFN worker hung; the tokens are the in-process engine's,
greedy and seeded; a replica SIGKILLed mid-stream loses nothing.
"""

from __future__ import annotations

import asyncio
import io
import os
import signal
from pathlib import Path

import pytest

from services.launcher.top import run_top
from tests.test_mesh_e2e import ask_greedy_and_seeded, generate
from tests.test_mesh_faults import MAX_TOKENS, _child_pid, _run
from tools.launch import aflex_up, until_plan


def test_aflex_up_on_a_cpu_host_serves_the_whole_model_in_one_worker_and_says_so(
        tiny_chat_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # `aflex top`'s table, whole
    greedy = generate(tiny_chat_checkpoint, max_tokens=10, temperature=0.0, seed=None)
    seeded = generate(tiny_chat_checkpoint, max_tokens=10, temperature=0.8, seed=7)
    with aflex_up(str(tiny_chat_checkpoint), split=False, open_nats=True) as mesh:
        texts = ask_greedy_and_seeded(mesh, 4)
        top = io.StringIO()
        assert asyncio.run(run_top(f"nats://127.0.0.1:{mesh.nats_port}", once=True, interval_s=2.5, out=top)) == 0
        log = mesh.output()
    assert texts == [greedy["text"], seeded["text"]] * 2  # the engine's tokens
    serving = next(line for line in log.splitlines() if "AFlex is serving" in line)
    assert "the whole model in one worker" in serving
    assert "[attn-0]" in log and "[ffn-0]" not in log  # no FFN worker was started
    assert "attn-0" in top.getvalue() and "whole model (colocated)" in top.getvalue()


def test_colocated_replicas_serve_the_engines_tokens_without_the_ffn_worker_and_lose_nothing(
        tiny_chat_checkpoint: Path) -> None:
    greedy = generate(tiny_chat_checkpoint, max_tokens=10, temperature=0.0, seed=None)
    seeded = generate(tiny_chat_checkpoint, max_tokens=10, temperature=0.8, seed=7)
    with aflex_up(str(tiny_chat_checkpoint), "--attention-workers", "2", "--ffn-workers", "1", "--colocate",
                  "--provision-window-s", "1", "--provision-kinds", "colocated", "--gpu-profile", "a800",
                  open_nats=True) as mesh:
        plan = asyncio.run(until_plan(mesh, lambda p: p.kind == "colocated", 90.0))
        replicas = sorted(w for w, a in plan.assignments.items() if a == "colocated")
        assert replicas and set(replicas) <= {"attn-0", "attn-1"} and plan.pools["colocated"] == [len(replicas), 1]
        assert plan.assignments["ffn-0"] in ("parked-warm", "parked-cold")
        ffn_pid = _child_pid(mesh, "ffn-0")
        os.kill(ffn_pid, signal.SIGSTOP)  # hung: a microbatch that needed it would wait, then fail
        try:
            texts = ask_greedy_and_seeded(mesh, 4)
        finally:
            os.kill(ffn_pid, signal.SIGCONT)
        assert texts == [greedy["text"], seeded["text"]] * 2

        baseline = asyncio.run(_run(mesh, sampled=True, count=4))
        serving = asyncio.run(until_plan(mesh, lambda p: p.kind == "colocated", 30.0))
        victim = sorted(w for w, a in serving.assignments.items() if a == "colocated")[0]
        after_fault = asyncio.run(_run(mesh, kill=victim, sampled=True, count=4))
        log = mesh.output()
    assert f"{victim} exited with status -9" in log
    assert [tokens for _, tokens in after_fault] == [MAX_TOKENS] * 4
    assert after_fault == baseline

"""`aflex top`: TopState's bookkeeping on constructed messages, and the command on a real nats-server."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
from typing import Any

import orjson
import pytest

from services.launcher.top import TopState, clock_text, main, render, run_top
from shared import subjects
from shared.messages import PhaseLatency, SchedulerTelemetry, WorkerTelemetry, encode
from shared.transport import bus


def worker(wid: str, role: str = "attention", **kw: Any) -> WorkerTelemetry:
    fields: dict[str, Any] = {"worker_id": wid, "role": role, "ts": 1.0, "gpu_backend": "emulated",
                              "gpu_name": "A800", "clock_mhz": 1410, "power_w": 100.0, "energy_j": 0.0,
                              "utilization": 0.5}
    return WorkerTelemetry(**{**fields, **kw})


def sched(**kw: Any) -> SchedulerTelemetry:
    fields: dict[str, Any] = {"scheduler_id": "scheduler-0", "ts": 1.0, "queue_depth": 3, "running": 7,
                              "finished": 11, "slo_attainment": 0.95, "ttft_p90_ms": 210.0, "tpot_p90_ms": 48.5}
    return SchedulerTelemetry(**{**fields, **kw})


def feed(state: TopState, msg: WorkerTelemetry | SchedulerTelemetry, now: float = 0.0) -> None:
    if isinstance(msg, SchedulerTelemetry):
        subject = subjects.telemetry("scheduler", msg.scheduler_id)
    else:
        subject = subjects.telemetry(msg.role, msg.worker_id)
    assert state.update(subject, encode(msg), now) is not None


def text_of(renderable: Any) -> str:
    buf = io.StringIO()
    from rich.console import Console

    Console(file=buf, width=250).print(renderable)
    return buf.getvalue()


def test_energy_per_token_and_cluster_totals() -> None:
    state = TopState()
    feed(state, worker("attn-0", energy_j=1000.0, tokens_done=500, power_w=120.0))
    feed(state, worker("ffn-0", "ffn", energy_j=2000.0, tokens_done=500, power_w=200.0))
    assert state.workers["attn-0"].joules_per_token is None  # nothing done since top started
    feed(state, worker("attn-0", energy_j=1050.0, tokens_done=600, power_w=130.0))
    feed(state, worker("ffn-0", "ffn", energy_j=2150.0, tokens_done=600, power_w=210.0))
    assert state.workers["attn-0"].joules_per_token == pytest.approx(0.5)
    assert state.workers["ffn-0"].joules_per_token == pytest.approx(1.5)
    totals = state.totals()
    assert totals.workers == 2 and totals.power_w == pytest.approx(340.0)
    assert totals.energy_j == pytest.approx(3200.0) and totals.energy_delta_j == pytest.approx(200.0)
    assert totals.tokens_delta == 100  # the attention workers' tokens: FFN tokens are the same tokens
    assert totals.joules_per_token == pytest.approx(2.0)

    feed(state, worker("attn-0", energy_j=5.0, tokens_done=1))  # restarted: counters went back
    assert state.workers["attn-0"].joules_per_token is None and state.workers["attn-0"].energy_delta_j == 0
    assert state.update("aflex.v1.telemetry.ffn.x", b"{not json") is None and state.invalid == 1


def test_ffn_only_cluster_uses_ffn_tokens() -> None:
    state = TopState()
    feed(state, worker("ffn-0", "ffn", energy_j=0.0, tokens_done=0))
    feed(state, worker("ffn-0", "ffn", energy_j=30.0, tokens_done=10))
    assert state.totals().joules_per_token == pytest.approx(3.0)


def test_not_applied_and_table() -> None:
    readonly = worker("attn-1", clock_mhz=1410, target_clock_mhz=600, command_applied=False,
                      latency_ms={"decode": PhaseLatency(mean_ms=4.25, count=3)}, kv_blocks_used=12,
                      kv_blocks_total=64, queue_depth=2)
    assert clock_text(readonly).plain == "1410 → 600 (not applied)"
    assert clock_text(worker("a", clock_mhz=600, target_clock_mhz=600)).plain == "600"
    state = TopState()
    feed(state, readonly)
    feed(state, worker("ffn-0", "ffn", power_w=250.0), now=0.0)
    feed(state, sched())
    out = text_of(render(state, now=10.0))
    assert "(not applied)" in out and "decode 4.2" in out and "12/64" in out and "emulated: A800" in out
    assert "ffn-0 (stale)" in out  # rendered 10 s after its last message
    assert "scheduler-0" in out and "95.0%" in out and "210.0" in out and "48.5" in out
    assert "cluster" in out and "350.0" in out
    assert "no telemetry yet" in text_of(render(TopState()))


async def _publish_while(url: str, task: asyncio.Task[int], n: int = 1000) -> None:
    nc = await bus.connect(url, "test-telemetry")
    try:
        for i in range(n):
            if task.done():
                break
            for msg in (worker("attn-0", energy_j=10.0 * i, tokens_done=5 * i, power_w=150.0 + i),
                        worker("ffn-0", "ffn", energy_j=20.0 * i, tokens_done=5 * i, command_applied=False,
                               target_clock_mhz=900)):
                await nc.publish(subjects.telemetry(msg.role, msg.worker_id), encode(msg))
            await nc.publish(subjects.telemetry("scheduler", "scheduler-0"), encode(sched(finished=i)))
            await asyncio.sleep(0.05)
    finally:
        await bus.close(nc)


def test_once_prints_one_table(nats_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # the table whole (a runner may have set a narrow terminal's width)
    out = io.StringIO()
    state, printed = TopState(), asyncio.Event()

    async def watch() -> None:  # the table is printed once top has heard two rounds of every source
        while not (len(state.workers) == 2 and state.schedulers and state.messages >= 6):
            await asyncio.sleep(0.01)
        printed.set()

    async def scenario() -> int:
        task = asyncio.create_task(run_top(nats_url, once=True, interval_s=60.0, out=out, stop=printed,
                                           state=state))
        watcher = asyncio.create_task(watch())
        await _publish_while(nats_url, task)
        watcher.cancel()
        return await task

    assert asyncio.run(scenario()) == 0
    text = out.getvalue()
    assert "attn-0" in text and "ffn-0" in text and "scheduler-0" in text and "(not applied)" in text
    assert "J/tok" in text and "2.000" in text and "6.000" in text  # 10 J / 5 tok; cluster 30 J / 5 attention tok


def test_json_lines(nats_url: str) -> None:
    """Through the real entry point in a child process, as a script would run it."""
    code = "import sys; from services.launcher.top import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "--nats", nats_url, "--json", "--once", "--interval", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        async def publish() -> None:
            nc = await bus.connect(nats_url, "test-telemetry")
            try:
                while proc.poll() is None:
                    msg = worker("attn-0", energy_j=1.5)
                    await nc.publish(subjects.telemetry("attention", "attn-0"), encode(msg))
                    await nc.publish(subjects.telemetry("scheduler", "scheduler-0"), encode(sched()))
                    await nc.publish(subjects.telemetry("ffn", "junk"), b"not telemetry")
                    await asyncio.sleep(0.05)
            finally:
                await bus.close(nc)

        asyncio.run(publish())
        stdout, stderr = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    lines = [orjson.loads(line) for line in stdout.splitlines()]
    assert lines, stderr
    by_subject = {line["subject"] for line in lines}
    assert by_subject == {"aflex.v1.telemetry.attention.attn-0", "aflex.v1.telemetry.scheduler.scheduler-0"}
    first = next(line for line in lines if line["subject"].endswith("attn-0"))
    assert first["message"]["worker_id"] == "attn-0" and first["message"]["energy_j"] == 1.5


def test_bad_url_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from shared.transport.nats_server import free_port

    assert main(["--nats", f"nats://127.0.0.1:{free_port()}", "--once"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aflex top: error: cannot connect to NATS at nats://127.0.0.1:")
    assert captured.out == ""


def test_the_global_schedulers_plan_and_assignments_show() -> None:
    from shared.messages import PlanTelemetry

    state = TopState()
    feed(state, worker("attn-1", assignment="parked-warm", clock_mhz=210))
    feed(state, worker("attn-0", assignment="mixed-attention"))
    plan = PlanTelemetry(scheduler_id="scheduler-0", ts=1.0, plan_id=4, kind="mixed", pools={"mixed": [1, 1, 1]},
                         assignments={"attn-0": "mixed-attention", "attn-1": "parked-warm", "ffn-0": "ffn"},
                         changed=["attn-1"], predicted_power_w=312.0, load_rps=0.42)
    assert state.update(subjects.TELEMETRY_PLAN, encode(plan), 0.0) == plan
    text = text_of(render(state, 0.0))
    assert "attention (parked-warm)" in text and "attention (mixed" not in text
    assert "plan 4 (mixed): mixed 1/1/1; 1 parked; for 0.42 req/s, 312 W predicted; changed attn-1" in text

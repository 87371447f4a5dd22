"""Nothing is lost when a worker dies or the NATS server restarts: the sequences recompute.

`aflex up`; 8 greedy streams start; mid-stream an attention worker or an FFN worker is SIGKILLed, or
the nats-server is stopped and started again; every stream still completes with its full length and
exactly the text it gets when nothing fails (recomputing a greedy sequence gives the same tokens).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from shared.transport.nats_server import EmbeddedNatsServer, free_port
from tools.launch import Mesh, aflex_up
from tools.story_stream import stream_story

MAX_TOKENS = 160
DOOMED_TOKENS = 900  # a killed gateway's streams: long enough to be running when it is found gone


def _child_pid(mesh: Mesh, worker_id: str) -> int:
    """The pid of `aflex up`'s child running `worker_id` (or the service named so)."""
    try:
        return mesh.pid_of(worker_id)
    except LookupError as exc:
        raise AssertionError(str(exc)) from None


def _child(mesh: Mesh, worker_id: str) -> tuple[int, list[str], dict[str, str]]:
    """`worker_id`'s process under `aflex up` (or the service's: "scheduler", "gateway"): pid, argv, environment."""
    pid = _child_pid(mesh, worker_id)
    argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return pid, argv, dict(e.decode().split("=", 1) for e in environ if b"=" in e)


async def _stream(client: openai.AsyncOpenAI, model: str, i: int, started: asyncio.Event, sampled: bool = False
                  ) -> tuple[str, int]:
    story = await stream_story(client, model, i, started, MAX_TOKENS, temperature=0.8 if sampled else 0,
                               seed=1000 + i if sampled else None)
    return story.text, story.tokens


async def _run(mesh: Mesh, kill: str | None = None, fault: Callable[[], None] | None = None, count: int = 8,
               sampled: bool = False, base_url: str | None = None) -> list[tuple[str, int]]:
    """`count` streams (with `sampled`, the odd ones seeded and sampled), faulted once all are decoding."""
    client = openai.AsyncOpenAI(base_url=base_url or mesh.base_url, api_key="unused", max_retries=0, timeout=300)
    model = (await client.models.list()).data[0].id
    started = [asyncio.Event() for _ in range(count)]
    streams = [asyncio.create_task(_stream(client, model, i, started[i], sampled and i % 2 == 1))
               for i in range(count)]
    if kill is not None or fault is not None:
        await asyncio.gather(*(e.wait() for e in started))  # every stream is decoding, on both workers
        assert not any(s.done() for s in streams)
        if kill is not None:
            os.kill(_child_pid(mesh, kill), signal.SIGKILL)
        if fault is not None:
            fault()
    return await asyncio.gather(*streams)


def test_attention_worker_loss_loses_no_request(tiny_chat_checkpoint: Path) -> None:
    with aflex_up(str(tiny_chat_checkpoint), "--attention-workers", "2", "--ffn-workers", "1") as mesh:
        baseline = asyncio.run(_run(mesh, kill=None))
        after_fault = asyncio.run(_run(mesh, kill="attn-0"))
        log = mesh.output()
        assert "attn-0 exited with status -9" in log
        assert "attn-0 lost while running" in log  # it was serving some of the streams when it died
    assert [tokens for _, tokens in after_fault] == [MAX_TOKENS] * 8
    assert after_fault == baseline


@pytest.mark.parametrize("depth", ["1", "2"])
def test_ffn_worker_loss_loses_no_request(tiny_chat_checkpoint: Path, depth: str) -> None:
    """With 2 FFN workers, SIGKILL one mid-stream: its seam groups break (gloo sees the connection
    close), the hops waiting on it fail at once, not at a timeout, their sequences re-run with the
    other FFN worker, and every stream completes with the no-fault text."""
    with aflex_up(str(tiny_chat_checkpoint), "--attention-workers", "1", "--ffn-workers", "2",
                  "--microbatch-depth", depth) as mesh:
        baseline = asyncio.run(_run(mesh, kill=None))
        after_fault = asyncio.run(_run(mesh, kill="ffn-0"))
        log = mesh.output()
        assert "ffn-0 exited with status -9" in log
        assert "seam to ffn-0 lost" in log  # microbatches were waiting on it when it died
        assert "Timed out" not in log  # none waited for a timeout
    assert [tokens for _, tokens in after_fault] == [MAX_TOKENS] * 8
    assert after_fault == baseline


def test_a_nats_server_restart_loses_no_request(tiny_chat_checkpoint: Path) -> None:
    """The nats-server stops mid-stream and a new one starts on its port: every service reconnects,
    the microbatches in flight when the scheduler's connection dropped whose Done was lost (if one was)
    are found from the worker's next heartbeat rather than at their timeout, their sequences recompute, and
    every stream completes with the no-fault text. (The seam tensors do not go through NATS: the
    seam itself does not notice.)"""
    port = free_port()
    servers = [EmbeddedNatsServer(port=port).start()]

    def restart() -> None:
        servers[-1].stop()
        servers.append(EmbeddedNatsServer(port=port).start())

    try:
        with aflex_up(str(tiny_chat_checkpoint), "--microbatch-depth", "2",
                      nats_url=servers[0].url) as mesh:
            baseline = asyncio.run(_run(mesh))
            after_fault = asyncio.run(_run(mesh, fault=restart))
            log = mesh.output()
    finally:
        servers[-1].stop()
    # A Done published across the restart may be lost or may wait in the worker's reconnect buffer (timing):
    # every microbatch taken for lost is one in flight when the connection dropped, found from a heartbeat,
    # and none waited for the microbatch timeout
    assert log.count("does not have microbatch") == log.count("(in flight when the NATS connection dropped)")
    assert "within 120.0 s" not in log
    assert [tokens for _, tokens in after_fault] == [MAX_TOKENS] * 8
    assert after_fault == baseline


def test_restarted_workers_rejoin_and_serve(tiny_chat_checkpoint: Path) -> None:
    """SIGKILL the FFN worker: `aflex up` starts it again (same id and settings, a new seam address), the
    attention worker opens a new seam group to it and streams come out as before; then the same for
    the attention worker, whose new process joins the FFN worker's store afresh."""
    with aflex_up(str(tiny_chat_checkpoint), "--attention-workers", "1", "--ffn-workers", "1",
                  "--microbatch-depth", "1") as mesh:
        baseline = asyncio.run(_run(mesh))
        for worker_id in ("ffn-0", "attn-0"):
            pid = _child_pid(mesh, worker_id)
            os.kill(pid, signal.SIGKILL)
            _wait_for(lambda w=worker_id, p=pid: _child_pid(mesh, w) != p)  # type: ignore[misc]
            assert _serves_again(mesh) == baseline[0][0], f"after restarting {worker_id}"
            assert asyncio.run(_run(mesh)) == baseline
        log = mesh.output()
    assert "ffn-0 exited with status -9" in log and "attn-0 exited with status -9" in log
    assert "restarting ffn-0 in" in log and "restarting attn-0 in" in log


def test_a_killed_scheduler_loses_no_request(tiny_chat_checkpoint: Path) -> None:
    """SIGKILL the scheduler mid-stream: `aflex up` starts it again, the workers register with the new
    run (dropping the old run's sequences), the gateway sees the old run's heartbeats stop and
    resubmits each request as a continuation of what it streamed, and every stream completes with
    its full length and exactly the no-fault text: the greedy ones, and the seeded sampled ones, whose
    draws continue from the same seed position."""
    with aflex_up(str(tiny_chat_checkpoint), "--microbatch-depth", "2") as mesh:
        baseline = asyncio.run(_run(mesh, sampled=True))
        killed_at = time.monotonic()
        after_fault = asyncio.run(_run(mesh, kill="scheduler", sampled=True))
        print(f"8 streams through a scheduler SIGKILL: done {time.monotonic() - killed_at:.1f} s after the kill")
        log = mesh.output()
    assert "scheduler exited with status -9" in log and "restarting scheduler in" in log
    assert "is gone; resubmitting after" in log and "taken by scheduler run" in log
    assert "a new scheduler; freeing the" in log
    assert [tokens for _, tokens in after_fault] == [MAX_TOKENS] * 8
    assert after_fault == baseline


def test_a_killed_gateway_is_survived_by_the_other_and_its_requests_are_cancelled(tiny_chat_checkpoint: Path
                                                                                  ) -> None:
    """Two gateways serve one mesh; SIGKILL the second while its streams decode: the first one's streams
    complete with the no-fault text, and the scheduler, missing the dead gateway's heartbeats, cancels
    the requests it had submitted (nobody could read them any more). The doomed streams are long, and the
    silence short, so that they still run when the scheduler notices (the running-set bound may hold the
    first gateway's new streams back meanwhile, so the doomed ones run alone and fast)."""
    silence = {"AFLEX_GATEWAY_SILENCE_S": "2.5"}  # five of the gateway's heartbeats
    with aflex_up(str(tiny_chat_checkpoint), "--gateways", "2", env_extra=silence) as mesh:
        second = mesh.base_url.replace(f":{mesh.port}/", f":{mesh.port + 1}/")
        baseline = asyncio.run(_run(mesh))

        async def both() -> tuple[list[tuple[str, int]], list[BaseException | object]]:
            client = openai.AsyncOpenAI(base_url=second, api_key="unused", max_retries=0, timeout=300)
            model = (await client.models.list()).data[0].id
            started = [asyncio.Event() for _ in range(4)]
            doomed = [asyncio.create_task(stream_story(client, model, 100 + i, started[i], DOOMED_TOKENS))
                      for i in range(4)]
            await asyncio.gather(*(e.wait() for e in started))
            os.kill(mesh.pid_of(f"gateway:{mesh.port + 1}"), signal.SIGKILL)
            served = await _run(mesh)
            return served, list(await asyncio.gather(*doomed, return_exceptions=True))

        served, doomed = asyncio.run(both())
        _wait_for(lambda: "is gone: cancelling its 4 requests" in mesh.output())
        log = mesh.output()
    assert served == baseline
    assert all(isinstance(result, openai.APIError) for result in doomed), doomed  # their connection went
    assert "gateway-1 exited with status -9" in log


def test_a_paused_gateway_taken_for_gone_continues_its_requests(tiny_chat_checkpoint: Path) -> None:
    """Found by the fault campaign (benchmarks/chaos.py, seed 1): a gateway paused longer than the scheduler's
    `gateway_silence_s` (SIGSTOP here; a long GC pause or a stalled host alike) is taken for gone and its
    requests cancelled; when it runs again, its clients are still connected. It gets their ends as `abort`s
    it never asked for, and takes each request over as a continuation of what it streamed: every stream
    completes with exactly the no-fault text (before the fix: cut short, finish_reason "abort"). The streams
    are long, so that they still run when the scheduler gives the gateway up."""
    silence = {"AFLEX_GATEWAY_SILENCE_S": "1"}
    with aflex_up(str(tiny_chat_checkpoint), env_extra=silence) as mesh:

        async def stories(fault: Callable[[], None] | None) -> list[tuple[str, int]]:
            client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=300)
            model = (await client.models.list()).data[0].id
            started = [asyncio.Event() for _ in range(4)]
            streams = [asyncio.create_task(stream_story(client, model, i, started[i], DOOMED_TOKENS))
                       for i in range(4)]
            if fault is not None:
                await asyncio.gather(*(e.wait() for e in started))
                fault()
            return [(story.text, story.tokens) for story in await asyncio.gather(*streams)]

        def pause_gateway() -> None:
            pid = mesh.pid_of("gateway")
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(2.5, os.kill, (pid, signal.SIGCONT)).start()  # the fault: a 2.5 s pause

        baseline = asyncio.run(stories(None))
        after_fault = asyncio.run(stories(pause_gateway))
        log = mesh.output()
    assert re.search(r"is gone: cancelling its [1-9]", log)  # the scheduler did take it for gone, mid-stream
    assert [tokens for _, tokens in after_fault] == [DOOMED_TOKENS] * 4
    assert after_fault == baseline
    assert "taking this gateway for gone" in log


def _wait_for(condition: Callable[[], bool], deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            if condition():
                return
        except AssertionError:  # between the old process and the new one
            pass
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.2)


def _serves_again(mesh: Mesh, deadline_s: float = 90.0) -> str:
    """Stream 0's text, retried (the mesh is not ready while a worker is being replaced) until it comes."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return asyncio.run(_run(mesh, count=1))[0][0]
        except openai.APIError:
            assert time.monotonic() < deadline, "the mesh did not serve again"
            time.sleep(0.5)


def test_the_only_ffn_worker_gone_for_good_ends_the_running_streams_within_the_bound(tiny_chat_checkpoint: Path
                                                                                    ) -> None:
    """The only FFN worker hangs for good mid-stream (SIGSTOP: nobody restarts it): once it is found silent
    (heartbeat_timeout_s) and `unserved_bound_s` has passed, every running stream ends with a typed error event
    instead of waiting with no end, and /ready says 503 meanwhile."""
    silence_s, bound_s = 2.0, 3.0
    settings = {"AFLEX_HEARTBEAT_TIMEOUT_S": str(silence_s), "AFLEX_UNSERVED_BOUND_S": str(bound_s)}
    with aflex_up(str(tiny_chat_checkpoint), env_extra=settings) as mesh:
        pid = _child_pid(mesh, "ffn-0")

        async def hang_mid_stream() -> tuple[list[object], float, int]:
            client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=300)
            model = (await client.models.list()).data[0].id
            started = [asyncio.Event() for _ in range(4)]
            streams = [asyncio.create_task(_stream(client, model, i, started[i])) for i in range(4)]
            await asyncio.gather(*(e.wait() for e in started))
            os.kill(pid, signal.SIGSTOP)
            hung = time.monotonic()
            outcomes = await asyncio.gather(*streams, return_exceptions=True)
            took_s = time.monotonic() - hung
            async with httpx.AsyncClient() as http:
                ready = (await http.get(mesh.base_url.removesuffix("/v1") + "/ready")).status_code
            return outcomes, took_s, ready

        try:
            outcomes, took_s, ready = asyncio.run(hang_mid_stream())
        finally:
            os.kill(pid, signal.SIGCONT)
    assert all(isinstance(o, openai.APIError) and "unserved_bound_s" in str(o) for o in outcomes), outcomes
    assert took_s < silence_s + bound_s + 5.0, took_s
    assert ready == 503

"""SIGTERM drains every service: what it holds finishes, it takes nothing new, it exits 0.

`aflex up`; 8 greedy streams start; once all are decoding, one service gets SIGTERM (as `docker compose
stop` or a Kubernetes rollout sends it): the gateway, the scheduler, an attention worker or an FFN
worker. Every stream completes with exactly the no-fault text, and the service exits with status 0 once
drained. A drained worker's sequences finished where they were (nothing was lost and recomputed), and the
mesh goes on serving with the other worker of its role.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import openai

from tools.launch import Mesh, aflex_up
from tools.story_stream import stream_story

MAX_TOKENS = 160
STREAMS = 8


async def _stories(mesh: Mesh, sigterm: str | None = None, max_tokens: int = MAX_TOKENS) -> list[tuple[str, int]]:
    """`STREAMS` greedy stories; with `sigterm`, that child of `aflex up` gets SIGTERM once all are decoding."""
    client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=300)
    model = (await client.models.list()).data[0].id
    started = [asyncio.Event() for _ in range(STREAMS)]
    streams = [asyncio.create_task(stream_story(client, model, i, started[i], max_tokens)) for i in range(STREAMS)]
    if sigterm is not None:
        await asyncio.gather(*(e.wait() for e in started))
        assert not any(s.done() for s in streams)  # the signal lands mid-stream
        os.kill(mesh.pid_of(sigterm), signal.SIGTERM)
    return [(story.text, story.tokens) for story in await asyncio.gather(*streams)]


def _until_exited(mesh: Mesh, name: str, deadline_s: float = 60.0) -> str:
    """`aflex up`'s output once it has reported `name`'s exit (it drains, then exits: an event, not a delay)."""
    deadline = time.monotonic() + deadline_s
    while f"{name} exited" not in (log := mesh.output()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return log


def _drained_while_serving(model: str, sigterm: str, drained_line: str, *mesh_args: str, more: bool,
                           max_tokens: int = MAX_TOKENS) -> None:
    with aflex_up(model, *mesh_args) as mesh:
        baseline = asyncio.run(_stories(mesh, max_tokens=max_tokens))
        during = asyncio.run(_stories(mesh, sigterm=sigterm, max_tokens=max_tokens))
        assert during == baseline  # (the gateway's 960-token streams end ~9 s after its SIGTERM)
        assert [tokens for _, tokens in during] == [max_tokens] * STREAMS
        if more:  # the mesh serves on without the drained worker
            assert asyncio.run(_stories(mesh)) == baseline
        log = _until_exited(mesh, sigterm)
    assert drained_line in log
    assert f"{sigterm} exited with status 0" in log
    assert "lost while running" not in log  # nothing it held was taken back and recomputed


def test_sigterm_to_the_gateway_finishes_its_streams(tiny_chat_checkpoint: Path) -> None:
    _drained_while_serving(str(tiny_chat_checkpoint), "gateway", "drained", more=False, max_tokens=960)


def test_sigterm_to_the_scheduler_finishes_its_requests(tiny_chat_checkpoint: Path) -> None:
    _drained_while_serving(str(tiny_chat_checkpoint), "scheduler", "scheduler scheduler-0 drained", more=False)


def test_sigterm_to_an_attention_worker_finishes_its_sequences_there(tiny_chat_checkpoint: Path) -> None:
    _drained_while_serving(str(tiny_chat_checkpoint), "attn-0", "attention worker attn-0 drained",
                           "--attention-workers", "2", "--ffn-workers", "1", more=True)


def test_sigterm_to_an_ffn_worker_moves_its_microbatches(tiny_chat_checkpoint: Path) -> None:
    _drained_while_serving(str(tiny_chat_checkpoint), "ffn-0", "ffn worker ffn-0 drained",
                           "--attention-workers", "1", "--ffn-workers", "2", more=True)

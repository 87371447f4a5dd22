"""The whole mesh, started by `aflex up`, against the official `openai` client.

Real nats-server, real scheduler, attention and FFN worker processes, real gateway. The tokens
it serves are the tokens `aflex generate` (the in-process engine) gives for the same seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from services.launcher import cli
from tools.launch import Mesh, aflex_up

QUESTION = "Tell me about the sea."


def ask_greedy_and_seeded(mesh: Mesh, count: int, max_tokens: int = 10) -> list[str | None]:
    """`count` concurrent answers to QUESTION through the official client, greedy (even) and seeded
    with seed 7 at temperature 0.8 (odd): what `generate` answers with those settings."""
    client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def ask(i: int) -> str | None:
        temperature, seed = (0.0, None) if i % 2 == 0 else (0.8, 7)
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=max_tokens,
            temperature=temperature, seed=seed, extra_body={"ignore_eos": True}).choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(ask, range(count)))


@functools.cache  # one run per question: several mesh tests check against the same answer
def generate(model: Path | str, *, max_tokens: int, temperature: float, seed: int | None,
             quantize: str = "none") -> dict:
    """`aflex generate --json`'s answer: its command line, run in this process (a subprocess would pay
    torch's import again, 2 s of the 3 s a run takes here)."""
    argv = ["generate", "--model", str(model), "--chat", "--prompt", QUESTION, "--max-tokens", str(max_tokens),
            "--temperature", str(temperature), "--json", "--ignore-eos", "--quantize", quantize]
    if seed is not None:
        argv += ["--seed", str(seed)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(argv) == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def tiny_mesh(tiny_chat_checkpoint: Path) -> Iterator[Mesh]:
    with aflex_up(str(tiny_chat_checkpoint), open_nats=True) as mesh:  # a test here reads sched.done
        yield mesh


def _client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


def _model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (0.8, 42)])
def test_stream_and_non_stream_give_generate_tokens(tiny_mesh: Mesh, tiny_chat_checkpoint: Path,
                                                    temperature: float, seed: int | None) -> None:
    expected = generate(tiny_chat_checkpoint, max_tokens=12, temperature=temperature, seed=seed)
    client = _client(tiny_mesh)
    model = _model_id(client)
    messages = [{"role": "user", "content": QUESTION}]
    extra = {"ignore_eos": True}
    response = client.chat.completions.create(model=model, messages=messages, max_tokens=12,  # type: ignore[arg-type]
                                              temperature=temperature, seed=seed, extra_body=extra)
    assert response.choices[0].message.content == expected["text"]
    assert response.usage is not None and response.usage.completion_tokens == len(expected["token_ids"])
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=12,  # type: ignore[arg-type]
                                            temperature=temperature, seed=seed, stream=True,
                                            stream_options={"include_usage": True}, extra_body=extra)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected["text"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_32_concurrent_streams_complete_with_their_lengths(tiny_mesh: Mesh) -> None:
    async def one(client: openai.AsyncOpenAI, model: str, max_tokens: int) -> int:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Count to {max_tokens}."}], max_tokens=max_tokens,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        assert usage is not None
        return usage.completion_tokens

    async def run() -> list[int]:
        client = openai.AsyncOpenAI(base_url=tiny_mesh.base_url, api_key="unused", max_retries=0, timeout=300)
        model = (await client.models.list()).data[0].id
        return await asyncio.gather(*(one(client, model, 4 + i % 9) for i in range(32)))

    assert asyncio.run(run()) == [4 + i % 9 for i in range(32)]


def test_request_energy_adds_up_to_the_workers_energy(tiny_mesh: Mesh) -> None:
    """usage.energy_j of every request sums to the energy of the microbatches that served them, and
    that is at most what the workers' GPUs (emulated A800s) report spending over the run."""
    import nats

    from shared import subjects
    from shared.messages import MicrobatchDone, WorkerTelemetry, decode

    async def run() -> tuple[float, float, float]:
        nc = await nats.connect(tiny_mesh.telemetry_url)
        dones: list[MicrobatchDone] = []
        latest: dict[str, list[float]] = {}

        async def on_done(msg: object) -> None:
            dones.append(decode(MicrobatchDone, msg.data))  # type: ignore[attr-defined]

        async def on_telemetry(msg: object) -> None:
            data = msg.data  # type: ignore[attr-defined]
            if msg.subject.split(".")[3] in ("attention", "ffn"):  # type: ignore[attr-defined]
                t = decode(WorkerTelemetry, data)
                latest.setdefault(t.worker_id, []).append(t.energy_j)

        await nc.subscribe(subjects.SCHED_DONE, cb=on_done)
        await nc.subscribe(subjects.TELEMETRY_ALL, cb=on_telemetry)
        await asyncio.sleep(0.5)
        start = {w: e[-1] for w, e in latest.items()}
        client = openai.AsyncOpenAI(base_url=tiny_mesh.base_url, api_key="unused", max_retries=0, timeout=120)
        model = (await client.models.list()).data[0].id
        responses = await asyncio.gather(*(client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Question {i}"}], max_tokens=5,
            extra_body={"ignore_eos": True}) for i in range(6)))
        await asyncio.sleep(0.5)
        await nc.drain()
        usage_j = sum(r.usage.model_extra["energy_j"] for r in responses)  # type: ignore[union-attr]
        done_j = sum(d.energy_j or 0.0 for d in dones)
        worker_j = sum(latest[w][-1] - start[w] for w in start)
        return usage_j, done_j, worker_j

    usage_j, done_j, worker_j = asyncio.run(run())
    assert usage_j > 0
    assert usage_j == pytest.approx(done_j, rel=1e-9)
    assert done_j <= worker_j


@pytest.mark.parametrize(("body", "status"), [
    ({"messages": []}, 400),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400),
    ({"messages": "hi"}, 400),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "no-such-model"}, 404),
    ({"messages": [{"role": "user", "content": "word " * 3000}]}, 400),
])
def test_bad_requests_get_4xx_and_the_mesh_keeps_serving(tiny_mesh: Mesh, body: dict, status: int) -> None:
    model = _model_id(_client(tiny_mesh))
    response = httpx.post(f"{tiny_mesh.base_url}/chat/completions", json={"model": model, **body}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    ok = _client(tiny_mesh).chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=3, extra_body={"ignore_eos": True})
    assert ok.usage is not None and ok.usage.completion_tokens == 3


# 1+1 at the default depth (auto) is `tiny_mesh`'s (the tests above); each doubled role at depths 1 and 2
TOPOLOGIES = [("1", "1", "1"), ("2", "1", "1"), ("1", "2", "2"), ("2", "2", "2")]


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=[f"{a}a{f}f-depth{d}" for a, f, d in TOPOLOGIES])
def test_topologies_serve_generate_tokens(tiny_chat_checkpoint: Path, topology: tuple[str, str, str]) -> None:
    """1+1, 2+1, 1+2 and 2+2 meshes, at microbatch depth 1 and 2, give `aflex generate`'s tokens."""
    expected = generate(tiny_chat_checkpoint, max_tokens=8, temperature=0.0, seed=None)
    attention, ffn, depth = topology
    with aflex_up(str(tiny_chat_checkpoint), "--attention-workers", attention, "--ffn-workers", ffn,
                  "--microbatch-depth", depth) as mesh:
        client = _client(mesh)
        model = _model_id(client)
        with ThreadPoolExecutor(4) as pool:  # several at once: both workers of a doubled role get work, depth 2 splits
            texts = list(pool.map(lambda _: client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True}).choices[0].message.content, range(4)))
        assert texts == [expected["text"]] * 4


def test_the_nats_seam_serves_the_same_tokens(tiny_chat_checkpoint: Path) -> None:
    """`--seam-transport nats` (seam tensors as NATS messages, for workers that reach each other only
    through NATS) is a whole mesh too."""
    expected = generate(tiny_chat_checkpoint, max_tokens=8, temperature=0.0, seed=None)
    with aflex_up(str(tiny_chat_checkpoint), "--seam-transport", "nats", "--microbatch-depth", "2") as mesh:
        client = _client(mesh)
        model = _model_id(client)
        with ThreadPoolExecutor(4) as pool:  # several sequences, so that depth 2 splits them
            texts = list(pool.map(lambda _: client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True}).choices[0].message.content, range(4)))
        assert texts == [expected["text"]] * 4


def test_int8_mesh_serves_the_int8_engine_tokens(tiny_chat_checkpoint: Path) -> None:
    """`aflex up --quantize int8`: each half quantises its own projections, and the split mesh gives
    the in-process int8 engine's tokens, which differ from float32's."""
    expected = generate(tiny_chat_checkpoint, max_tokens=12, temperature=0.0, seed=None, quantize="int8")
    assert expected["token_ids"] != generate(tiny_chat_checkpoint, max_tokens=12, temperature=0.0,
                                             seed=None)["token_ids"]
    with aflex_up(str(tiny_chat_checkpoint), "--quantize", "int8") as mesh:
        client = _client(mesh)
        response = client.chat.completions.create(model=_model_id(client), max_tokens=12, temperature=0,
                                                  messages=[{"role": "user", "content": QUESTION}],
                                                  extra_body={"ignore_eos": True})
        assert response.choices[0].message.content == expected["text"]


def test_smollm2_answers_paris() -> None:
    with aflex_up("default") as mesh:
        client = _client(mesh)
        response = client.chat.completions.create(
            model=_model_id(client), messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20, temperature=0)
        assert "Paris" in (response.choices[0].message.content or "")
        assert response.choices[0].finish_reason == "stop"

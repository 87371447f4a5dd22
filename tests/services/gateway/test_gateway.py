"""The gateway end to end over a real nats-server, with a fake scheduler, through the official openai client.

The gateway runs as it does in production (`serve()`: uvicorn on a free port, one event loop shared with
its NATS connection) in a background thread; the fake scheduler, on the same loop, answers status and
submissions and publishes scripted output deltas of a known text.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar, cast

import httpx2 as httpx  # the HTTP client under openai>=3 (httpx itself is not installed here)
import openai
import orjson
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.gateway.app import create_app, serve
from shared import subjects
from shared.messages import (
    CancelRequest,
    ErrorBody,
    FinishReason,
    OutputDelta,
    SchedulerStatus,
    SubmitReply,
    SubmitRequest,
    Usage,
    decode,
    encode,
)
from shared.model.checkpoint import ModelCard, open_model_card
from shared.settings import GatewaySettings
from shared.transport import bus
from shared.transport.nats_server import EmbeddedNatsServer, free_port

T = TypeVar("T")
TEXT = "The capital of France is Paris."
ENERGY_J = 1.25


class FakeScheduler:
    """Answers like the scheduler: `mode` is ok | slow | overload | silent | error."""

    def __init__(self, nc: Client, card: ModelCard) -> None:
        assert card.tokenizer is not None
        self.nc = nc
        self.eos = card.args.eos_token_ids[0]
        self.script = [*card.tokenizer.encode(TEXT), self.eos]
        self.mode = "ok"
        self.ready = True
        self.submissions: list[SubmitRequest] = []
        self.cancels: list[CancelRequest] = []
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._subs = [
            await self.nc.subscribe(subjects.REQ_SUBMIT, queue=subjects.SCHEDULER_QUEUE, cb=self._on_submit),
            await self.nc.subscribe(subjects.SCHED_STATUS, cb=self._on_status),
            await self.nc.subscribe(subjects.REQ_CANCEL_ALL, cb=self._on_cancel),
        ]
        await self.nc.flush()

    async def stop(self) -> None:
        """Gone: nobody answers submissions or status (cancels are not recorded meanwhile)."""
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs = []
        await self.nc.flush()

    async def _on_status(self, msg: Msg) -> None:
        status = SchedulerStatus(ready=self.ready, scheduler_id="fake", model_id="SmolLM2-135M-Instruct")
        await msg.respond(encode(status))

    async def _on_cancel(self, msg: Msg) -> None:
        self.cancels.append(decode(CancelRequest, msg.data))

    async def _on_submit(self, msg: Msg) -> None:
        req = decode(SubmitRequest, msg.data)
        self.submissions.append(req)
        if self.mode == "overload":
            error = ErrorBody(type="overloaded_error", message="the queue is full", code="queue_full")
            await msg.respond(encode(SubmitReply(request_id=req.request_id, accepted=False, error=error,
                                                 retry_after_s=2.5)))
            return
        await msg.respond(encode(SubmitReply(request_id=req.request_id, accepted=True)))
        if self.mode == "shed":  # taken, then refused before its first token (queue_deadline_s passed)
            error = ErrorBody(type="overloaded_error", message="waited 10 s without starting", code="queue_deadline")
            await self.nc.publish(subjects.req_out(req.request_id), encode(OutputDelta(
                request_id=req.request_id, index=0, token_ids=[], finish_reason="error", error=error,
                retry_after_s=2.5)))
        elif self.mode != "silent":
            task = asyncio.create_task(self._generate(req))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _cancelled(self, request_id: str) -> bool:
        return any(c.request_id == request_id for c in self.cancels)

    async def _generate(self, req: SubmitRequest) -> None:
        out = subjects.req_out(req.request_id)
        tokens = self.script[:req.sampling.max_tokens]
        finish: FinishReason = "stop" if len(tokens) == len(self.script) else "length"
        chunks = [tokens[:1]] + [tokens[i:i + 2] for i in range(1, len(tokens), 2)]  # multi-token deltas too
        delay = 0.1 if self.mode == "slow" else 0.01
        for index, chunk in enumerate(chunks):
            await asyncio.sleep(delay)
            if self._cancelled(req.request_id):
                return
            last = index == len(chunks) - 1
            if self.mode == "error" and index == 1:
                error = ErrorBody(type="server_error", message="attention worker attn-0 died")
                await self.nc.publish(out, encode(OutputDelta(request_id=req.request_id, index=index, token_ids=[],
                                                              finish_reason="error", error=error)))
                return
            usage = Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=len(tokens),
                          total_tokens=len(req.prompt_ids) + len(tokens), energy_j=ENERGY_J) if last else None
            await self.nc.publish(out, encode(OutputDelta(request_id=req.request_id, index=index, token_ids=chunk,
                                                          finish_reason=finish if last else None, usage=usage)))


class Harness:
    def __init__(self, fake: type[FakeScheduler] = FakeScheduler, **settings: Any) -> None:
        self.nats = EmbeddedNatsServer().start()
        self.card = open_model_card("default")
        self.port = free_port()
        self.settings = GatewaySettings(nats_url=self.nats.url, host="127.0.0.1", port=self.port,
                                        **{"request_timeout_s": 1.0, "submit_timeout_s": 2.0, "log_level": "WARNING",
                                           **settings})
        self.base = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stop_event = self.call(self._make_event())
        self.nc = self.call(bus.connect(self.nats.url, "fake-scheduler"))
        self.fake = fake(self.nc, self.card)
        self.call(self.fake.start())
        self.server = asyncio.run_coroutine_threadsafe(serve(self.settings, stop=self.stop_event), self.loop)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        else:
            raise RuntimeError("the gateway did not come up")
        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="x", max_retries=0, timeout=10)

    @staticmethod
    async def _make_event() -> asyncio.Event:
        return asyncio.Event()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=20)

    def wait_for_cancel(self, request_id: str, timeout_s: float = 3.0) -> CancelRequest:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for c in self.fake.cancels:
                if c.request_id == request_id:
                    return c
            time.sleep(0.02)
        raise AssertionError(f"no cancel for {request_id}")

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.server.result(timeout=15)
        self.call(bus.close(self.nc))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.nats.stop()


@pytest.fixture(scope="module")
def h() -> Iterator[Harness]:
    harness = Harness()
    try:
        yield harness
    finally:
        harness.close()


@pytest.fixture(autouse=True)
def _reset(h: Harness) -> None:
    h.fake.mode = "ok"
    h.fake.ready = True


MODEL = "SmolLM2-135M-Instruct"
MESSAGES: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_non_streaming(h: Harness) -> None:
    resp = h.client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, seed=7,
                                            extra_body={"top_k": 5, "ignore_eos": True, "min_tokens": 2, "unknown": 1})
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-") and resp.model == MODEL
    choice = resp.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.logprobs is None
    assert choice.message.content == TEXT and choice.finish_reason == "stop"
    sub = h.fake.submissions[-1]
    assert sub.request_id == resp.id
    tok = h.card.tokenizer
    assert tok is not None
    assert sub.prompt_ids == tok.encode(tok.apply_chat_template(MESSAGES))
    assert sub.sampling.temperature == 0 and sub.sampling.seed == 7 and sub.sampling.top_k == 5
    assert sub.sampling.ignore_eos and sub.sampling.min_tokens == 2
    assert sub.sampling.max_tokens == 1024  # default: the rest of the context, capped
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(sub.prompt_ids) and resp.usage.completion_tokens == len(h.fake.script)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.usage.model_extra == {"energy_j": ENERGY_J}


def test_chat_streaming_with_usage(h: Harness) -> None:
    chunks = list(h.client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                   stream_options={"include_usage": True}, max_tokens=50))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == len(h.fake.script) and last.usage.model_extra == {"energy_j": ENERGY_J}
    assert all(c.usage is None for c in body)
    assert [c.choices[0].finish_reason for c in body] == [None] * (len(body) - 1) + ["stop"]
    assert "".join(c.choices[0].delta.content or "" for c in body) == TEXT
    assert h.fake.submissions[-1].sampling.max_tokens == 50


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(h: Harness) -> None:
    chunks = list(h.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, max_tokens=50,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))  # type: ignore[typeddict-unknown-key]
    *body, last = chunks
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == len(h.fake.script)
    counts = [c.usage.completion_tokens for c in body if c.usage is not None]
    assert len(counts) == len(body) and counts == sorted(counts) and 0 < counts[-1] == len(h.fake.script)
    assert {c.usage.prompt_tokens for c in body if c.usage is not None} == {last.usage.prompt_tokens}


def test_stream_without_usage_has_no_usage_chunk(h: Harness) -> None:
    with httpx.stream("POST", f"{h.base}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                                      "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    events = [orjson.loads(line[6:]) for line in lines[:-1]]
    assert all("usage" not in e and e["choices"] for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_completions_with_token_ids(h: Harness) -> None:
    resp = h.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert resp.choices[0].text == "The capital of France" and resp.choices[0].finish_reason == "length"
    assert h.fake.submissions[-1].prompt_ids == [1, 2, 3]
    assert resp.usage is not None and resp.usage.prompt_tokens == 3 and resp.usage.completion_tokens == 4
    resp = h.client.completions.create(model=MODEL, prompt=[[4, 5]], max_tokens=2)
    assert h.fake.submissions[-1].prompt_ids == [4, 5]
    resp = h.client.completions.create(model=MODEL, prompt="Hello there")
    assert h.fake.submissions[-1].sampling.max_tokens == 16  # OpenAI's completions default
    stream = list(h.client.completions.create(model=MODEL, prompt=["Hello"], max_tokens=100, stream=True))
    assert "".join(c.choices[0].text for c in stream) == TEXT and stream[-1].choices[0].finish_reason == "stop"


def test_a_clients_x_request_id_is_the_requests_id_and_comes_back(h: Harness) -> None:
    raw = h.client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                                             extra_headers={"X-Request-Id": "bench-42_a:1"})
    assert raw.headers["x-request-id"] == "bench-42_a:1"
    assert raw.parse().id == "chatcmpl-bench-42_a:1" == h.fake.submissions[-1].request_id
    r = httpx.post(f"{h.base}/v1/completions", json={"model": MODEL, "prompt": "Hi"},
                   headers={"X-Request-Id": "a.b"})  # a dot cannot be a NATS subject token
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id"


def test_models(h: Harness) -> None:
    models = h.client.models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].object == "model"
    assert h.client.models.retrieve(MODEL).id == MODEL


def test_stop_string_truncates_and_cancels(h: Harness) -> None:
    resp = h.client.chat.completions.create(model=MODEL, messages=MESSAGES, stop=["Paris", "Berlin"])
    assert resp.choices[0].message.content == "The capital of France is " and resp.choices[0].finish_reason == "stop"
    assert h.wait_for_cancel(resp.id).reason == "stop_string"
    chunks = list(h.client.chat.completions.create(model=MODEL, messages=MESSAGES, stop="France", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "The capital of "
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert h.wait_for_cancel(chunks[0].id).reason == "stop_string"


def test_overload_is_429_with_retry_after(h: Harness) -> None:
    h.fake.mode = "overload"
    with pytest.raises(openai.RateLimitError) as info:
        h.client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert info.value.response.headers["retry-after"] == "3"
    assert cast(dict[str, Any], info.value.body)["type"] == "overloaded_error"


def test_no_scheduler_is_503_and_not_ready(h: Harness) -> None:
    assert httpx.get(f"{h.base}/ready").status_code == 200
    h.fake.ready = False
    assert httpx.get(f"{h.base}/ready").status_code == 503
    h.call(h.fake.stop())
    try:
        with pytest.raises(openai.InternalServerError) as info:
            h.client.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "1"
        r = httpx.get(f"{h.base}/ready")
        assert r.status_code == 503 and r.json()["status"] == "not_ready"
        assert httpx.get(f"{h.base}/health").status_code == 200
    finally:
        h.call(h.fake.start())


def test_scheduler_error_mid_request(h: Harness) -> None:
    h.fake.mode = "error"
    with pytest.raises(openai.InternalServerError) as info:
        h.client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert "attn-0 died" in info.value.message
    with httpx.stream("POST", f"{h.base}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                                      "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert orjson.loads(lines[-2][6:])["error"]["message"] == "attention worker attn-0 died"


def test_token_timeout_cancels(h: Harness) -> None:
    h.fake.mode = "silent"
    r = httpx.post(f"{h.base}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}, timeout=10)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert h.wait_for_cancel(r.headers["x-request-id"]).reason == "timeout"


def test_client_disconnect_cancels(h: Harness) -> None:
    h.fake.mode = "slow"
    with httpx.stream("POST", f"{h.base}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                                      "stream": True}) as r:
        request_id = r.headers["x-request-id"]
        next(line for line in r.iter_lines() if line)  # the first chunk, then hang up
    assert h.wait_for_cancel(request_id).reason == "client_disconnected"
    n_cancels = len(h.fake.cancels)
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
        httpx.post(f"{h.base}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}, timeout=0.3)
    request_id = h.fake.submissions[-1].request_id
    assert h.wait_for_cancel(request_id).reason == "client_disconnected"
    assert len(h.fake.cancels) == n_cancels + 1
    h.fake.mode = "silent"  # a streamed request whose client gives up before its first token (no status yet)
    body = {"model": MODEL, "messages": MESSAGES, "stream": True}
    with pytest.raises(httpx.ReadTimeout), httpx.stream("POST", f"{h.base}/v1/chat/completions", json=body,
                                                        timeout=0.3) as r:
        r.read()
    request_id = h.fake.submissions[-1].request_id
    assert h.wait_for_cancel(request_id).reason == "client_disconnected"
    assert len(h.fake.cancels) == n_cancels + 2


def test_a_request_shed_before_its_first_token_is_a_429_streamed_or_not(h: Harness) -> None:
    h.fake.mode = "shed"
    body = {"model": MODEL, "messages": MESSAGES}
    for stream in (True, False):
        r = httpx.post(f"{h.base}/v1/chat/completions", json={**body, "stream": stream}, timeout=10)
        assert r.status_code == 429, r.text
        assert r.headers["Retry-After"] == "3" and r.headers["retry-after-ms"] == "2500"
        assert r.json()["error"]["code"] == "queue_deadline" and r.headers["x-request-id"]


LONG = "hello " * 9000


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": "hi"}, 400, "messages"),
    ({"model": MODEL}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": -1}, 400, "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "n": 0}, 400, "n"),
    ({"model": MODEL, "messages": MESSAGES, "n": 17}, 400, "n"),
    ({"model": MODEL, "messages": MESSAGES, "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "messages": MESSAGES, "temperature": 3}, 400, "temperature"),
    ({"model": MODEL, "messages": MESSAGES, "stop": [""]}, 400, "stop"),
    ({"model": MODEL, "messages": MESSAGES, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": MODEL, "messages": MESSAGES, "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "min_tokens": 10**6}, 400, "min_tokens"),  # over the default max
    ({"model": "gpt-4", "messages": MESSAGES}, 404, "model"),
    ({"model": MODEL, "messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 8192}, 400, "messages"),
    ({"model": MODEL, "messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),  # without logprobs
    ({"model": MODEL, "messages": MESSAGES, "logprobs": False, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"model": MODEL, "messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"model": MODEL, "messages": MESSAGES, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    ({"model": MODEL, "messages": MESSAGES, "logprobs": 1}, 400, "logprobs"),
    ({"model": MODEL, "messages": MESSAGES, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"model": MODEL, "messages": MESSAGES, "repetition_penalty": 2.5}, 400, "repetition_penalty"),
])
def test_bad_chat_requests(h: Harness, body: dict[str, Any], status: int, param: str) -> None:
    r = httpx.post(f"{h.base}/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if status == 404:
        assert error["code"] == "model_not_found"


def test_min_tokens_is_checked_against_the_effective_max_tokens(h: Harness) -> None:
    """The spec's own rule (`SamplingParams.validate`), over the max_tokens the gateway settled on."""
    for extra, limit in (({"max_tokens": 2}, 2), ({}, 1024)):  # none asked: the chat default
        r = httpx.post(f"{h.base}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                              "min_tokens": 2000, **extra})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "min_tokens" and f"max_tokens={limit}" in error["message"], error


@pytest.mark.parametrize(("body", "param"), [
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
    ({"model": MODEL, "prompt": [1, -2]}, "prompt"),
    ({"model": MODEL, "prompt": [10**7]}, "prompt"),
    ({"model": MODEL, "prompt": [1, 2], "max_tokens": 8191}, "prompt"),
    ({"model": MODEL, "prompt": "a", "logprobs": 21}, "logprobs"),
    ({"model": MODEL, "prompt": "a", "logprobs": -1}, "logprobs"),
    ({"model": MODEL, "prompt": "a", "logprobs": True}, "logprobs"),
    ({"model": MODEL, "prompt": "a", "echo": "yes"}, "echo"),
    ({"model": MODEL, "prompt": [1] * 9600, "echo": True, "logprobs": 20}, "logprobs"),  # 201,600 logprobs
])
def test_bad_completion_requests(h: Harness, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{h.base}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_malformed_json_and_client_errors(h: Harness) -> None:
    r = httpx.post(f"{h.base}/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        h.client.chat.completions.create(model=MODEL, messages=MESSAGES, n=0)
    with pytest.raises(openai.NotFoundError):
        h.client.chat.completions.create(model="nope", messages=MESSAGES)
    assert httpx.get(f"{h.base}/v1/nowhere").json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("keys", ["sekret", "other, sekret"])
def test_api_key(h: Harness, keys: str) -> None:
    settings = h.settings.model_copy(update={"api_key": keys})
    app = create_app(settings, h.card, cast(Client, None))  # these routes never touch NATS

    async def check() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            r = await c.get("/v1/models")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert (await c.get("/v1/models", headers={"Authorization": "Bearer wrong"})).status_code == 401
            assert (await c.get("/v1/models", headers={"Authorization": "Bearer sekret"})).status_code == 200
            assert (await c.get("/health")).status_code == 200
            for path in ("/ready", "/metrics"):
                assert (await c.get(path)).status_code != 401, path
            assert (await c.get("/v1/models", headers={"x-api-key": "sekret"})).status_code == 200  # Anthropic's
            refused = await c.post("/v1/messages/count_tokens", json={"messages": []}, headers={"x-api-key": "no"})
            assert refused.status_code == 401  # in Anthropic's shape on its routes
            assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "authentication_error"

    asyncio.run(check())


def test_gateway_does_not_import_torch() -> None:
    code = ("import sys, services.gateway.app, services.gateway.streaming, services.gateway.generation; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_serve_stops_cleanly_on_sigterm() -> None:
    with EmbeddedNatsServer() as nats_server:
        port = free_port()
        code = ("import asyncio; from services.gateway.app import serve; from shared.settings import GatewaySettings; "
                f"asyncio.run(serve(GatewaySettings(nats_url={nats_server.url!r}, host='127.0.0.1', port={port}, "
                "log_level='WARNING')))")
        proc = subprocess.Popen([sys.executable, "-c", code])
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.05)
            else:
                raise AssertionError("the gateway did not come up")
            assert httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 503  # no scheduler
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

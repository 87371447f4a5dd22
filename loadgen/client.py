"""An async streaming client for OpenAI-compatible servers: bounded concurrency, no retries.

Timing follows vLLM's `endpoint_request_func.py`: `st` = time.perf_counter() just before the POST; the
SSE stream is split into messages on blank lines, `:` comment lines are skipped, `data:` is stripped,
`[DONE]` ends. Every message with a non-empty `choices` list is a token chunk: the first gives TTFT,
the next ones append to ITL; a message without choices but with `usage` gives the token counts (and
AFlex's `usage.energy_j`). E2EL is the time of the last non-[DONE] message (the usage chunk included).
A non-200 status, a transport error, an `error` object in the stream or a stream without a single
choices message fails the request (its error is kept); failed requests are never retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadgen.metrics import RequestResult
from loadgen.workloads import RequestSpec

Prompt = str | list[int]


@dataclass
class ClientConfig:
    base_url: str  # ends in /v1
    model: str
    endpoint: str = "completions"  # or "chat"
    api_key: str | None = None
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    temperature: float = 0.0
    force_length: bool = True  # ignore_eos + min_tokens (vLLM/SGLang/AFlex extensions)
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{self.base_url.rstrip('/')}/{path}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def build_payload(config: ClientConfig, prompt: Prompt, output_len: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": config.model, "temperature": config.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if config.endpoint == "chat":
        if not isinstance(prompt, str):
            raise ValueError("the chat endpoint takes text prompts only")
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = output_len
    else:
        body["prompt"] = prompt
        body["max_tokens"] = output_len
    if config.force_length:
        body["ignore_eos"] = True
        body["min_tokens"] = output_len
    body.update(config.extra_body)
    return body


def _sse_messages(buffer: bytearray) -> list[str]:
    """Complete SSE events taken off the front of `buffer`, each as its joined `data:` payload."""
    out: list[str] = []
    while True:
        text = bytes(buffer).replace(b"\r\n", b"\n")
        end = text.find(b"\n\n")
        if end < 0:
            if len(text) != len(buffer):
                buffer[:] = text
            return out
        event, rest = text[:end], text[end + 2:]
        buffer[:] = rest
        datas = []
        for line in event.decode("utf-8", errors="replace").split("\n"):
            if not line or line.startswith(":"):
                continue
            if line.startswith("data:"):
                datas.append(line[5:].removeprefix(" "))
        if datas:
            out.append("\n".join(datas))


def _error_text(obj: Any) -> str:
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(obj)


async def send_request(client: httpx.AsyncClient, config: ClientConfig, spec: RequestSpec, prompt: Prompt,
                       t_origin: float = 0.0) -> RequestResult:
    result = RequestResult(spec.index, spec.input_len, spec.output_len)
    body = build_payload(config, prompt, spec.output_len)
    chat = config.endpoint == "chat"
    st = time.perf_counter()
    result.start_time = st - t_origin
    most_recent = st
    first = False
    texts: list[str] = []
    try:
        async with client.stream("POST", config.url, json=body, headers=config.headers()) as response:
            if response.status_code != 200:
                raw = await response.aread()
                try:
                    detail = _error_text(json.loads(raw))
                except ValueError:
                    detail = raw.decode("utf-8", errors="replace")[:300]
                result.error = f"HTTP {response.status_code} {response.reason_phrase}: {detail}"
                return result
            buffer = bytearray()
            async for piece in response.aiter_bytes():
                buffer.extend(piece)
                for message in _sse_messages(buffer):
                    if message.strip() == "[DONE]":
                        continue
                    timestamp = time.perf_counter()
                    data = json.loads(message)
                    if "error" in data and not data.get("choices"):
                        result.error = f"stream error: {_error_text(data)}"
                    if choices := data.get("choices"):
                        if not first:
                            first = True
                            result.ttft = timestamp - st
                        else:
                            result.itl.append(timestamp - most_recent)
                        result.chunks += 1
                        choice = choices[0]
                        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                        texts.append(text or "")
                    if usage := data.get("usage"):
                        result.output_tokens = usage.get("completion_tokens")
                        result.prompt_tokens = usage.get("prompt_tokens")
                        if usage.get("energy_j") is not None:
                            result.energy_j = float(usage["energy_j"])
                    most_recent = timestamp
        result.latency = most_recent - st
        result.generated_text = "".join(texts)
        if result.error:
            return result
        if not first:
            result.error = "Never received a valid chunk to calculate TTFT."
            return result
        result.success = True
    except (httpx.HTTPError, OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return result


Progress = Callable[[RequestResult], None]


@dataclass
class RunOutcome:
    results: list[RequestResult]
    duration_s: float
    started_wall: float  # time.time() at the start
    started_perf: float  # time.perf_counter() at the start


async def run_requests(config: ClientConfig, specs: Sequence[RequestSpec], prompts: Sequence[Prompt], *,
                       on_done: Progress | None = None) -> RunOutcome:
    """Send every request at its arrival time (semaphore-limited, like vLLM); results in spec order."""
    limit = config.max_concurrency
    semaphore = asyncio.Semaphore(limit) if limit else None
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeout = httpx.Timeout(config.request_timeout_s, connect=min(30.0, config.request_timeout_s))
    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=httpx.AsyncHTTPTransport(retries=0,
                                                                                                    limits=limits)
                                 ) as client:
        t0 = time.perf_counter()
        wall0 = time.time()

        async def one(spec: RequestSpec, prompt: Prompt) -> RequestResult:
            if semaphore is None:
                result = await send_request(client, config, spec, prompt, t0)
            else:
                async with semaphore:
                    result = await send_request(client, config, spec, prompt, t0)
            if on_done is not None:
                with contextlib.suppress(Exception):
                    on_done(result)
            return result

        tasks = []
        for spec, prompt in zip(specs, prompts, strict=True):
            delay = t0 + spec.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec, prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return RunOutcome(list(results), duration, wall0, t0)


async def discover_model(base_url: str, api_key: str | None, timeout_s: float = 30.0) -> str:
    """The first model `GET /v1/models` lists (what vLLM and SGLang's benchmarks do without --model)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        response = await client.get(f"{base_url.rstrip('/')}/models", headers=headers)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])


async def prompt_tokens_of(config: ClientConfig, prompt: Prompt, timeout_s: float = 120.0) -> int:
    """How many prompt tokens the server counts for `prompt` (one non-streamed request, 1 output token)."""
    body = build_payload(config, prompt, 1)
    body["stream"] = False
    body.pop("stream_options", None)
    body.pop("min_tokens", None)
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        response = await client.post(config.url, json=body, headers=config.headers())
        if response.status_code != 200:
            raise RuntimeError(f"calibration request failed: HTTP {response.status_code}: {response.text[:300]}")
        return int(response.json()["usage"]["prompt_tokens"])

"""The fault campaign's requests: a fixed mix, each one repeatable, and what a client saw of it.

Every request is a (kind, k) pair: the same pair always sends the same body, and greedy or seeded
sampling makes its answer a function of the pair. The standard phase records each pair's answer with
nothing failing; under faults every answer must equal it. `run` plays one pair the way an ordinary client
behind a load balancer would: a connection the gateway dropped (it died) is tried again on the other gateway,
from the start, with a backoff, while the bound allows; an OpenAI-style error is an answer too (typed);
anything else is a failure the campaign counts: a hang past the bound, a 5xx without an error body, a
stream that closed without its `[DONE]`, a token streamed twice or skipped, usage that does not add up, a
connection no gateway took within the bound.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import openai

KINDS = ("chat-stream", "chat-seeded", "completion-logprobs", "chat-n2", "tool-call", "multi-turn")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
RETRY_FIRST_WAIT_S, RETRY_MAX_WAIT_S = 0.5, 4.0  # a dropped connection is tried again after these
HISTORY = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]


@dataclass
class Outcome:
    """What one request came to. `answer` is comparable across runs (texts, tool calls); `status` is one of ok,
    mismatch, typed_error, untyped_error, cut (a stream that closed without its end), hung, bad_usage."""

    kind: str
    k: int
    status: str = "ok"
    answer: list[str] = field(default_factory=list)
    error: str = ""  # the error code (typed) or what went wrong
    message: str = ""  # a typed error's message
    retried: bool = False  # its gateway dropped the connection: tried again on the other one
    started: float = 0.0  # time.monotonic()
    ended: float = 0.0
    ttft_s: float | None = None
    tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "k": self.k, "status": self.status, "error": self.error, "message": self.message,
                "retried": self.retried,
                "started": round(self.started, 3), "ended": round(self.ended, 3), "ttft_s": self.ttft_s,
                "tokens": self.tokens}


def _usage_ok(usage: Any) -> bool:
    """`usage` with token counts that add up and AFlex's `energy_j` (the energy the workers spent on it)."""
    fields = usage if isinstance(usage, dict) else usage.model_dump() if usage is not None else {}
    prompt, completion, total = (fields.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
    energy_j = fields.get("energy_j")
    return (isinstance(prompt, int) and isinstance(completion, int) and completion > 0
            and total == prompt + completion and isinstance(energy_j, int | float) and energy_j >= 0)


async def _lines(response: Any) -> AsyncIterator[str]:
    """A raw streaming response's lines, a dropped connection raised as the client's `APIConnectionError` (its
    own stream iterator does so; its raw lines leave the transport's error, httpx's or httpx2's, as it is)."""
    try:
        async for line in response.iter_lines():
            yield line
    except Exception as exc:
        if not any(cls.__name__ == "TransportError" for cls in type(exc).__mro__):
            raise
        raise openai.APIConnectionError(message=f"{type(exc).__name__}: {exc}",
                                        request=response.http_response.request) from exc


async def _chat_stream(client: openai.AsyncOpenAI, model: str, out: Outcome, messages: list[dict[str, Any]],
                       **extra: Any) -> None:
    """A streamed chat, read event by event (the SSE lines themselves, not the client's iterator, which ends
    quietly on a stream cut short): the stream must end with `data: [DONE]`, and, with logprobs of token ids
    asked for, carry each token once, in order: the ids, one per sampled token, are part of the answer (a
    token sent twice or skipped does not equal the no-fault answer) and their count must be the usage's."""
    text, finish, usage, done = "", None, None, False
    token_ids: list[str] = []
    async with client.chat.completions.with_streaming_response.create(  # type: ignore[call-overload]
            model=model, messages=messages, stream=True, stream_options={"include_usage": True}, logprobs=True,
            extra_body={"return_tokens_as_token_ids": True}, **extra) as response:
        async for line in _lines(response):
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:  # an error event ends the stream: typed if it is an OpenAI-style error object
                error = chunk["error"] if isinstance(chunk["error"], dict) else {}
                out.status = "typed_error" if isinstance(error.get("type"), str) else "untyped_error"
                out.error = f"stream {error.get('code') or error.get('type') or chunk['error']}"
                out.message = str(error.get("message", ""))
                continue
            for choice in chunk.get("choices") or []:
                delta = (choice.get("delta") or {}).get("content") or ""
                if delta and out.ttft_s is None:
                    out.ttft_s = time.monotonic() - out.started
                text += delta
                token_ids += [t["token"] for t in ((choice.get("logprobs") or {}).get("content") or [])]
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    if out.status != "ok":
        if not done:
            out.status, out.error = "cut", f"{out.error}, then no [DONE]"
        return
    if finish is None or not done:
        out.status, out.error = "cut", f"the stream ended without {'[DONE]' if finish else 'a finish_reason'}"
        return
    out.answer = [text, finish, " ".join(token_ids)]
    if not _usage_ok(usage) or usage["completion_tokens"] != len(token_ids):  # type: ignore[index]
        out.status, out.error = "bad_usage", f"usage {usage} for {len(token_ids)} streamed tokens"
        return
    assert usage is not None
    out.tokens = usage["completion_tokens"]
    out.answer.append(f"prompt_tokens {usage['prompt_tokens']}")


async def _send(client: openai.AsyncOpenAI, model: str, out: Outcome) -> None:
    k = out.k
    if out.kind == "chat-stream":
        await _chat_stream(client, model, out, [{"role": "user", "content": f"Tell me story number {k}."}],
                           max_tokens=48, temperature=0)
    elif out.kind == "multi-turn":  # the history's prefix is cached after its first turn
        await _chat_stream(client, model, out, [*HISTORY, {"role": "user", "content": f"And number {k}?"}],
                           max_tokens=32, temperature=0)
    elif out.kind == "completion-logprobs":
        answer = await client.completions.create(model=model, prompt=f"Once upon a time, {k}", max_tokens=32,
                                                 temperature=0, logprobs=2)
        choice = answer.choices[0]
        if choice.logprobs is None or len(choice.logprobs.tokens or []) != answer.usage.completion_tokens:  # type: ignore[union-attr]
            out.status, out.error = "bad_usage", "logprobs do not cover the tokens"
        out.answer = [choice.text, str(choice.finish_reason)]
        out.tokens = answer.usage.completion_tokens if answer.usage else 0
        if out.status == "ok" and not _usage_ok(answer.usage):
            out.status, out.error = "bad_usage", f"usage {answer.usage}"
        out.answer.append(f"prompt_tokens {answer.usage.prompt_tokens if answer.usage else None}")
    else:
        body: dict[str, Any] = {"chat-seeded": {"messages": [{"role": "user", "content": f"A word for {k}:"}],
                                                "max_tokens": 24, "temperature": 0.8, "seed": 100 + k},
                                "chat-n2": {"messages": [{"role": "user", "content": f"Count to {k + 3}."}],
                                            "max_tokens": 24, "temperature": 0.9, "seed": 200 + k, "n": 2},
                                "tool-call": {"messages": [{"role": "user", "content": f"Weather in city {k}?"}],
                                              "max_tokens": 40, "temperature": 0, "tools": [WEATHER_TOOL],
                                              "tool_choice": "required"}}[out.kind]
        answer = await client.chat.completions.create(model=model, **body)
        for choice in answer.choices:
            calls = [json.dumps([c.function.name, c.function.arguments]) for c in choice.message.tool_calls or []]
            out.answer += [choice.message.content or "", *calls, str(choice.finish_reason)]
        out.tokens = answer.usage.completion_tokens if answer.usage else 0
        if not _usage_ok(answer.usage):
            out.status, out.error = "bad_usage", f"usage {answer.usage}"
        out.answer.append(f"prompt_tokens {answer.usage.prompt_tokens if answer.usage else None}")


async def run(clients: list[openai.AsyncOpenAI], model: str, kind: str, k: int, first: int, bound_s: float
              ) -> Outcome:
    """Play (kind, k) on gateway `first` (of `clients`). A dropped connection (its gateway died) is tried
    again from the start on the next gateway, after a backoff that doubles (0.5 s, up to 4 s), while the
    bound allows: what a client behind a load balancer does when every gateway may be restarting."""
    out = Outcome(kind, k, started=time.monotonic())
    attempt = 0
    while True:
        client = clients[(first + attempt) % len(clients)]
        out.status, out.error, out.answer, out.ttft_s = "ok", "", [], None
        try:
            await asyncio.wait_for(_send(client, model, out), bound_s - (time.monotonic() - out.started))
        except TimeoutError:
            out.status, out.error = "hung", f"no end within {bound_s:g} s"
        except openai.APIStatusError as exc:
            body: dict[str, Any] = exc.body if isinstance(exc.body, dict) else {}
            error: dict[str, Any] = body["error"] if isinstance(body.get("error"), dict) else body  # either shape
            out.status = "typed_error" if isinstance(error.get("type"), str) else "untyped_error"
            out.error = f"{exc.status_code} {error.get('code') or ''}".strip()
            out.message = str(error.get("message", ""))
        except (openai.APIConnectionError, openai.APIResponseValidationError) as exc:
            out.status, out.error = "cut", f"{type(exc).__name__}: {exc} (after {attempt + 1} attempts)"
            backoff_s = min(RETRY_MAX_WAIT_S, RETRY_FIRST_WAIT_S * 2 ** attempt)
            if time.monotonic() + backoff_s - out.started < bound_s:
                out.retried, attempt = True, attempt + 1
                await asyncio.sleep(backoff_s)
                continue
        break
    out.ended = time.monotonic()
    return out

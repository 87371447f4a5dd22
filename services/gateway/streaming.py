"""OpenAI response bodies: the whole response, and the SSE chunks of a streamed one.

Streaming follows OpenAI and vLLM: the role chunk goes out with the first token's text (an early role
chunk would fake a tiny TTFT in benchmarks), content chunks follow, the last content chunk carries
`finish_reason`; with `stream_options.include_usage` every chunk has `"usage": null` and one more chunk
with `"choices": []` carries the usage (and with vLLM's `continuous_usage_stats` every chunk carries
the usage so far); `data: [DONE]` ends the stream, also after an error event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import orjson

from services.gateway.errors import APIError
from services.gateway.generation import Generation, TextEvent, usage_dict
from services.gateway.logprobs import Entry, LogprobFormat, prompt_entries

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


@dataclass(frozen=True)
class ResponseShape:
    """Identity of one response: the same id, created and model on every chunk."""

    id: str
    created: int
    model: str
    chat: bool

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, text: str, finish_reason: str | None, *, delta: dict[str, Any] | None = None,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.chat:
            key, value = ("delta", delta) if delta is not None else ("message", {"role": "assistant",
                                                                                  "content": text})
            return {"index": 0, key: value, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def response(self, text: str, finish_reason: str, usage: dict[str, Any], logprobs: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(obj, [self._choice(text, finish_reason, logprobs=logprobs)]), "usage": usage}

    def chunk(self, text: str, finish_reason: str | None = None, *, role: bool = False,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if role else (
                {"content": text} if text or finish_reason is None else {})
            return self._envelope("chat.completion.chunk",
                                  [self._choice(text, finish_reason, delta=delta, logprobs=logprobs)])
        return self._envelope("text_completion", [self._choice(text, finish_reason, logprobs=logprobs)])

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage}


@dataclass(frozen=True)
class Extras:
    """What a choice carries besides the text: logprobs (`format`), and an echoed prompt (completions)."""

    format: LogprobFormat | None = None
    echo_text: str | None = None  # None: no echo
    prompt_ids: tuple[int, ...] = ()

    def first(self, event: TextEvent) -> tuple[str, list[Entry]]:
        """The first event's text and entries, with the echoed prompt (and its logprobs) before them."""
        if self.echo_text is None:
            return event.text, event.logprobs
        return self.echo_text + event.text, prompt_entries(self.prompt_ids, event.prompt_logprobs) + event.logprobs

    def render(self, entries: list[Entry]) -> dict[str, Any] | None:
        return None if self.format is None else self.format.render(entries)


async def collect(shape: ResponseShape, generation: Generation, extras: Extras = Extras()) -> dict[str, Any]:
    """The whole response of a non-streamed request; `APIError` when the request failed."""
    texts: list[str] = []
    entries: list[Entry] = []
    async for event in generation.events():
        text, new = extras.first(event) if not texts else (event.text, event.logprobs)
        texts.append(text)
        entries += new
        if event.finish_reason is not None:
            return shape.response("".join(texts), event.finish_reason, event.usage or {}, extras.render(entries))
    raise AssertionError("events() ended without a finish reason")


async def stream(shape: ResponseShape, generation: Generation, include_usage: bool, continuous_usage: bool = False,
                 extras: Extras = Extras()) -> AsyncIterator[bytes]:
    """SSE bytes of a streamed request. Cancels the request when the client goes away before the end."""

    def extra() -> dict[str, Any]:
        if not include_usage:
            return {}
        if not continuous_usage:
            return {"usage": None}
        return {"usage": usage_dict(len(generation.prompt_ids), len(generation.output_ids))}

    sent_role = not shape.chat
    first = True
    try:
        async for event in generation.events():
            if not sent_role:
                sent_role = True
                yield sse({**shape.chunk("", role=True), **extra()})
            text, entries = extras.first(event) if first else (event.text, event.logprobs)
            first = False
            yield sse({**shape.chunk(text, event.finish_reason, logprobs=extras.render(entries)), **extra()})
            if event.finish_reason is not None and include_usage:
                yield sse(shape.usage_chunk(event.usage or {}))
        yield DONE
    except APIError as exc:  # the status line is sent already: an error event, then the end
        yield sse(exc.body())
        yield DONE
    finally:
        with anyio.CancelScope(shield=True):  # runs inside Starlette's cancelled scope on disconnect
            await generation.release("client_disconnected")

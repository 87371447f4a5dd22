"""OpenAI response bodies: the whole response, and the SSE chunks of a streamed one.

Streaming follows OpenAI and vLLM: the role chunk goes out with the first token's text (an early role
chunk would fake a tiny TTFT in benchmarks), content chunks follow, the last content chunk carries
`finish_reason`; with `stream_options.include_usage` every chunk has `"usage": null` and one more chunk
with `"choices": []` carries the usage (and with vLLM's `continuous_usage_stats` every chunk carries
the usage so far); `data: [DONE]` ends the stream, also after an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from services.gateway.errors import SERVER_ERROR, APIError
from services.gateway.generation import Generation, TextEvent, cached_tokens, reasoning_tokens, usage_dict
from services.gateway.logprobs import Entry, LogprobFormat, prompt_entries
from services.gateway.tool_call_stream import ToolCallStream, finish_with_calls, read_calls
from services.gateway.tool_call_syntax import Function, ToolCall, parse_tool_calls
from services.gateway.tool_calling import call_dicts, delta_dicts

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

    def choice(self, text: str | None, finish_reason: str | None, *, index: int = 0,
               delta: dict[str, Any] | None = None, logprobs: dict[str, Any] | None = None,
               tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            key, value = ("delta", delta) if delta is not None else ("message", message)
            return {"index": index, key: value, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def response(self, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(obj, choices), "usage": usage}

    def chunk(self, text: str, finish_reason: str | None = None, *, index: int = 0, role: bool = False,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if role else (
                {"content": text} if text or finish_reason is None else {})
            return self._envelope("chat.completion.chunk",
                                  [self.choice(text, finish_reason, index=index, delta=delta, logprobs=logprobs)])
        return self._envelope("text_completion", [self.choice(text, finish_reason, index=index, logprobs=logprobs)])

    def reasoning_chunk(self, reasoning: str, *, index: int = 0, logprobs: dict[str, Any] | None = None
                        ) -> dict[str, Any]:
        """A piece of a reasoning model's reasoning (vLLM's `reasoning_content` delta)."""
        delta = {"reasoning_content": reasoning}
        return self._envelope("chat.completion.chunk",
                              [self.choice(None, None, index=index, delta=delta, logprobs=logprobs)])

    def tool_chunk(self, calls: list[dict[str, Any]], *, index: int = 0) -> dict[str, Any]:
        """Pieces of a streamed answer's calls (`delta_dicts`: a call's first names it, later ones add arguments)."""
        delta = {"tool_calls": calls}
        return self._envelope("chat.completion.chunk", [self.choice("", None, index=index, delta=delta)])

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage}


@dataclass(frozen=True)
class Extras:
    """What a choice carries besides the text: logprobs (`format`), and an echoed prompt (completions)."""

    format: LogprobFormat | None = None
    echo_text: str | None = None  # None: no echo
    prompt_ids: tuple[int, ...] = ()
    functions: tuple[Function, ...] | None = None  # the offered functions, when the answer is read for calls
    reasoning: bool = False  # the model reasons: the message carries `reasoning_content` (None when it did not)

    def first(self, event: TextEvent) -> tuple[str, list[Entry]]:
        """The first event's text and entries, with the echoed prompt (and its logprobs) before them."""
        if self.echo_text is None:
            return event.text, event.logprobs
        return self.echo_text + event.text, prompt_entries(self.prompt_ids, event.prompt_logprobs) + event.logprobs

    def render(self, entries: list[Entry]) -> dict[str, Any] | None:
        return None if self.format is None else self.format.render(entries)


def total_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """The n choices' usage as one: the prompt counted once (as vLLM does), the completions summed."""
    energies = [u.get("energy_j") for u in usages]
    energy_j = None if any(e is None for e in energies) else sum(e for e in energies if e is not None)
    total = usage_dict(usages[0]["prompt_tokens"], sum(u["completion_tokens"] for u in usages), energy_j,
                       cached_tokens(usages[0]))
    if any("completion_tokens_details" in u for u in usages):  # a reasoning model's
        total["completion_tokens_details"] = {"reasoning_tokens": sum(reasoning_tokens(u) for u in usages)}
    return total


async def _collect_one(shape: ResponseShape, index: int, generation: Generation, extras: Extras
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
    texts: list[str] = []
    reasoning: list[str] = []
    entries: list[Entry] = []
    async for event in generation.events():
        text, new = extras.first(event) if not texts else (event.text, event.logprobs)
        texts.append(text)
        reasoning.append(event.reasoning)
        entries += new
        if event.finish_reason is not None:
            choice, usage = _answer(shape, index, "".join(texts), event, extras.render(entries), extras)
            if extras.reasoning:
                message = choice["message"]
                message["reasoning_content"] = "".join(reasoning) or None
                message["content"] = message["content"] or None  # all reasoning: no answer yet
            return choice, usage
    raise AssertionError("events() ended without a finish reason")


def _answer(shape: ResponseShape, index: int, text: str, event: TextEvent, logprobs: dict[str, Any] | None,
            extras: Extras) -> tuple[dict[str, Any], dict[str, Any]]:
    """A finished choice (its calls read from the answer where functions were offered), and its usage."""
    content: str | None = text
    calls: tuple[ToolCall, ...] = ()
    if extras.functions is not None:
        parsed = parse_tool_calls(text, extras.functions)
        content, calls = parsed.content, parsed.calls
        if not calls and event.finish_reason == "length":  # a call cut short is still a call
            content, calls = read_calls(text, extras.functions)
    if calls:
        finish = finish_with_calls(event.finish_reason, True)
        return (shape.choice(content, finish, index=index, logprobs=logprobs,
                             tool_calls=call_dicts(calls)), event.usage or {})
    return ({**shape.choice(text, event.finish_reason, index=index, logprobs=logprobs),
             "stop_reason": event.stop_sequence}, event.usage or {})  # vLLM's: the stop string hit


async def collect(shape: ResponseShape, generations: list[Generation], extras: list[Extras]) -> dict[str, Any]:
    """The whole response of a non-streamed request (its n choices together); `APIError` when one failed."""
    tasks = [asyncio.ensure_future(_collect_one(shape, i, g, e))
             for i, (g, e) in enumerate(zip(generations, extras, strict=True))]
    try:
        done = await asyncio.gather(*tasks)
    finally:  # one choice failed (or the client left): the others stop before their generations are released
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return shape.response([choice for choice, _ in done], total_usage([usage for _, usage in done]))


_END = object()  # a choice's events are over


async def _events(index: int, generation: Generation, into: asyncio.Queue[tuple[int, Any]]) -> None:
    try:
        async for event in generation.events():
            await into.put((index, event))
        await into.put((index, _END))
    except Exception as exc:  # an APIError, or a bug: the stream ends with an error event either way
        await into.put((index, exc))


class ChoiceEvents:
    """The n choices' events, merged as they come (each with its choice's index).

    One choice (n = 1, nearly every request) is read directly: no reader task and no queue between
    its generation and the response, one await less per token.
    """

    def __init__(self, generations: list[Generation]) -> None:
        self.generations = generations
        self._direct: AsyncIterator[TextEvent] | None = generations[0].events() if len(generations) == 1 else None
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._readers = [] if self._direct is not None else [
            asyncio.create_task(_events(i, g, self._queue)) for i, g in enumerate(generations)]
        self._running = len(generations)

    async def next(self) -> tuple[int, TextEvent] | None:
        """The next event of any choice; None when all are over; `APIError` when one failed."""
        if self._direct is not None:
            return await self._next_direct(self._direct)
        while self._running:
            index, event = await self._queue.get()
            if event is _END:
                self._running -= 1
                continue
            _raise_failure(event)
            return index, event
        return None

    async def _next_direct(self, events: AsyncIterator[TextEvent]) -> tuple[int, TextEvent] | None:
        if not self._running:
            return None
        try:
            return 0, await anext(events)
        except StopAsyncIteration:
            self._running = 0
            return None
        except Exception as exc:  # as a reader task would have passed it on
            self._running = 0
            _raise_failure(exc)
            raise

    async def close(self, reason: str) -> None:
        """Stop reading and release every choice's request (cancelled on the bus if still running)."""
        with anyio.CancelScope(shield=True):  # runs inside Starlette's cancelled scope on disconnect
            for reader in self._readers:
                reader.cancel()
            if isinstance(self._direct, AsyncGenerator):
                with contextlib.suppress(RuntimeError):  # still running in a task being cancelled: that ends it
                    await self._direct.aclose()  # its `finally`s run now, as a cancelled reader's would
            for generation in self.generations:
                await generation.release(reason)


def _raise_failure(event: object) -> None:
    """A choice's failure, as the response reports it: its `APIError`, or a 500 for anything else."""
    if isinstance(event, APIError):
        raise event
    if isinstance(event, Exception):
        raise APIError(500, f"the request failed: {event}", type=SERVER_ERROR) from event


class ChoiceStreamResponse(StreamingResponse):
    """A StreamingResponse that releases its choices however it ends: also when the status line could not
    be sent, or the client left before the body began (the generator's own `finally` never runs then)."""

    def __init__(self, events: ChoiceEvents, content: AsyncIterator[bytes], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.close("client_disconnected")


async def stream(shape: ResponseShape, events: ChoiceEvents, first: tuple[int, TextEvent] | None, include_usage: bool,
                 continuous_usage: bool, extras: list[Extras]) -> AsyncIterator[bytes]:
    """SSE bytes of a streamed request from its `first` event on (the status line waited for it, so a
    request refused before its first token got a real status), its n choices' chunks as they come, each
    with its `index`. Releases the requests at the end, or when the client goes away before it."""
    generations = events.generations

    def extra() -> dict[str, Any]:
        if not include_usage:
            return {}
        if not continuous_usage:
            return {"usage": None}
        return {"usage": usage_dict(len(generations[0].prompt_ids), sum(len(g.output_ids) for g in generations))}

    started = [False] * len(generations)
    usages: list[dict[str, Any]] = [{}] * len(generations)
    calls = [None if e.functions is None else ToolCallStream(e.functions) for e in extras]
    ids: list[dict[int, str]] = [{} for _ in extras]  # each choice's call ids, by call index
    try:
        item = first
        while item is not None:
            index, event = item
            if shape.chat and not started[index]:
                yield sse({**shape.chunk("", index=index, role=True), **extra()})
            text, entries = extras[index].first(event) if not started[index] else (event.text, event.logprobs)
            started[index] = True
            logprobs = extras[index].render(entries)
            if event.reasoning:  # reasoning first: its pieces never hold call syntax or the answer
                yield sse({**shape.reasoning_chunk(event.reasoning, index=index, logprobs=logprobs), **extra()})
                logprobs = None
                if not text and event.finish_reason is None:
                    item = await events.next()
                    continue
            reader = calls[index]
            if reader is None:
                yield sse({**shape.chunk(text, event.finish_reason, index=index, logprobs=logprobs), **extra()})
            else:  # content up to where a call may begin; each call's name, then its arguments as they come
                final = event.finish_reason is not None
                text, deltas = reader.take(text, final)
                finish = finish_with_calls(event.finish_reason, reader.called)
                if deltas:
                    if text or logprobs:
                        yield sse({**shape.chunk(text, index=index, logprobs=logprobs), **extra()})
                        text, logprobs = "", None
                    for group in delta_dicts(deltas, ids[index]):
                        yield sse({**shape.tool_chunk([group], index=index), **extra()})
                if text or logprobs or finish is not None:
                    yield sse({**shape.chunk(text, finish, index=index, logprobs=logprobs), **extra()})
            if event.finish_reason is not None:
                usages[index] = event.usage or {}
            item = await events.next()
        if include_usage:
            yield sse(shape.usage_chunk(total_usage(usages)))
        yield DONE
    except APIError as exc:  # the status line is sent already: an error event, then the end
        yield sse(exc.body())
        yield DONE
    finally:
        await events.close("client_disconnected")

"""A streamed answer, whatever its API: the n choices' events merged, read as parts, said by the API's renderer.

`ChoiceEvents` merges the choices' text events; `stream` reads them as parts (services.gateway.parts) and
gives each to the route's `Renderer`, which says it in its API's dialect (openai_render, responses_api,
messages_api): a new API is a new renderer. The response releases its requests however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from services.gateway.errors import SERVER_ERROR, APIError, json_bytes
from services.gateway.generation import Generation, TextEvent
from services.gateway.parts import Answer, Part, Reading, answer_parts
from shared.messages import SamplingSpec

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json_bytes(payload) + b"\n\n"


@dataclass(frozen=True)
class Identity:
    """One answer's identity: the same id, creation time and model on everything it sends."""

    id: str
    created: int
    model: str


class Renderer(Protocol):
    """One API's dialect: an answer's parts (services.gateway.parts) as that API's bytes, or its whole body.
    A stream is `opening`, then `part` for each part, then `closing`; or, when the answer fails after the
    status line went out, `error` in place of what is left (the API's error event and its end)."""

    def opening(self) -> list[bytes]:
        """What a stream says before any part (a Response's `created` and `in_progress`)."""
        ...

    def part(self, part: Part) -> list[bytes]:
        """One part in this dialect (nothing where the dialect has no word for it)."""
        ...

    def closing(self) -> list[bytes]:
        """What a stream says once every choice ended (OpenAI's usage chunk and `[DONE]`)."""
        ...

    def error(self, exc: APIError) -> list[bytes]:
        """A failure after the status line: the dialect's error event, then its end."""
        ...

    def whole(self, answers: list[Answer]) -> dict[str, Any]:
        """The body of a non-streamed answer, its choices in order."""
        ...


@dataclass(frozen=True)
class Dialect:
    """What the answer path needs of the API that asked: the prefix of its ids, whether it is a chat (a chat
    gets the rest of the context as its default budget, and a reasoning model's reasoning split from its
    answer), the field its prompt came in, and its renderer (services.gateway.streaming.Renderer)."""

    kind: str  # the request id's prefix: chatcmpl, cmpl, resp, msg
    chat: bool
    param: str
    renderer: Callable[[Answering], Renderer]


@dataclass(frozen=True)
class Answering:
    """What a renderer may know of the answer it says: its identity, prompt and choices."""

    identity: Identity
    prompt_ids: list[int]
    generations: list[Generation]
    sampling: SamplingSpec


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


async def stream(renderer: Renderer, events: ChoiceEvents, first: tuple[int, TextEvent] | None,
                 reading: Reading) -> AsyncIterator[bytes]:
    """The bytes of a streamed answer from its `first` event on (the status line waited for it, so a request
    refused before its first token got a real status), its choices' parts as they come. Releases the
    requests at the end, or when the client goes away before it."""
    try:
        for chunk in renderer.opening():
            yield chunk
        async for part in answer_parts(reading, first, events.next):
            for chunk in renderer.part(part):
                yield chunk
        for chunk in renderer.closing():
            yield chunk
    except APIError as exc:  # the status line is sent already: an error event, then the end
        for chunk in renderer.error(exc):
            yield chunk
    finally:
        await events.close("client_disconnected")

"""One answer as typed parts, whatever API asked for it: every API's renderer reads these and nothing else.

A choice's text events (generation.TextEvent) become, event by event: `Begin` at its first event, the
reasoning (`Reasoning`), the answer's text up to where a call may begin (`Text`), each call's start with
its id and name (`CallStart`) and its arguments as they are written (`CallArguments`), and on the last
event `End` with the finish reason, the usage, the stop string hit and the event's last piece of text.
Tool calls are read here once (tool_call_stream), their ids minted here once, and the finish reason of
an answer that made calls is decided here once: a renderer only says the parts in its API's dialect.

A whole (non-streamed) answer is read from the whole text instead (`collect`): calls are parsed from the
finished answer, and a call cut short by `max_tokens` still counts as one.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from services.gateway.generation import Generation, TextEvent
from services.gateway.logprobs import Entry, prompt_entries
from services.gateway.tool_call_stream import CallDelta, ToolCallStream, finish_with_calls, read_calls
from services.gateway.tool_call_syntax import Function, parse_tool_calls


def new_call_id() -> str:
    """A tool call's id (OpenAI's `call_...`; the other APIs' ids are made from it)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Reading:
    """How a request's answers are read: the same for each of its choices."""

    functions: tuple[Function, ...] | None = None  # offered functions, when the answer is read for calls
    logprobs: bool = False  # the request asked for logprobs
    echo_text: str | None = None  # completions' `echo`: the prompt comes first (None: no echo)
    prompt_ids: tuple[int, ...] = ()
    reasoning: bool = False  # the model reasons: its reasoning comes apart from the answer

    def first(self, event: TextEvent) -> tuple[str, list[Entry]]:
        """A choice's first event's text and entries, with the echoed prompt (and its logprobs) before them."""
        if self.echo_text is None:
            return event.text, event.logprobs
        return self.echo_text + event.text, prompt_entries(self.prompt_ids, event.prompt_logprobs) + event.logprobs


@dataclass(frozen=True)
class Begin:
    choice: int


@dataclass(frozen=True)
class Reasoning:
    choice: int
    text: str
    logprobs: list[Entry] | None  # None: not asked


@dataclass(frozen=True)
class Text:
    choice: int
    text: str
    logprobs: list[Entry] | None  # None: not asked, or given with the reasoning of the same event


@dataclass(frozen=True)
class CallStart:
    choice: int
    index: int  # the call's place among the answer's calls
    call_id: str
    name: str
    arguments: str  # the arguments' first piece, written in the same event


@dataclass(frozen=True)
class CallArguments:
    choice: int
    index: int
    arguments: str


@dataclass(frozen=True)
class End:
    """A choice's last part: its last piece of text (as `Text`), why it ended, and its usage."""

    choice: int
    finish_reason: str  # `tool_calls` where the answer made calls (finish_with_calls)
    usage: dict[str, Any]
    stop_sequence: str | None  # the stop string that ended it (None once it made calls: they ended it)
    text: str = ""
    logprobs: list[Entry] | None = None


Part = Begin | Reasoning | Text | CallStart | CallArguments | End


def _call_parts(choice: int, deltas: list[CallDelta]) -> list[Part]:
    """Call pieces as parts: a call's name and its arguments' first piece in one `CallStart`, the pieces of one
    call in a row as one `CallArguments`."""
    out: list[Part] = []
    for d in deltas:
        last = out[-1] if out else None
        if d.name is None and isinstance(last, CallStart | CallArguments) and last.index == d.index:
            out[-1] = (CallStart(choice, d.index, last.call_id, last.name, last.arguments + d.arguments)
                       if isinstance(last, CallStart) else CallArguments(choice, d.index, last.arguments + d.arguments))
        elif d.name is not None:
            out.append(CallStart(choice, d.index, new_call_id(), d.name, d.arguments))
        else:
            out.append(CallArguments(choice, d.index, d.arguments))
    return out


def _event_parts(reading: Reading, index: int, calls: ToolCallStream | None, event: TextEvent, *,
                 first: bool) -> list[Part]:
    """One event of choice `index` as parts (module docstring); `calls` reads the choice's calls across its
    events, `first`: the choice's first event."""
    out: list[Part] = [Begin(index)] if first else []
    text, entries = reading.first(event) if first else (event.text, event.logprobs)
    logprobs = entries if reading.logprobs else None
    final = event.finish_reason is not None
    if event.reasoning:  # reasoning first: its pieces never hold call syntax or the answer
        out.append(Reasoning(index, event.reasoning, logprobs))
        logprobs = None
        if not text and not final:
            return out
    finish = event.finish_reason
    if calls is not None:  # content up to where a call may begin; each call's name, then its arguments
        text, deltas = calls.take(text, final)
        finish = finish_with_calls(finish, calls.called)
        if deltas:
            if text or logprobs is not None:
                out.append(Text(index, text, logprobs))
                text, logprobs = "", None
            out += _call_parts(index, deltas)
    if finish is not None:
        called = calls is not None and calls.called
        out.append(End(index, finish, event.usage or {}, None if called else event.stop_sequence, text, logprobs))
    elif text or logprobs is not None:
        out.append(Text(index, text, logprobs))
    return out


async def answer_parts(reading: Reading, first: tuple[int, TextEvent] | None,
                       next_event: Callable[[], Awaitable[tuple[int, TextEvent] | None]]) -> AsyncIterator[Part]:
    """The parts of a streamed answer's choices, as their events come (`first`, then each `next_event()`;
    None when all choices are over)."""
    readers: dict[int, ToolCallStream | None] = {}  # each choice's, from its first event on
    item = first
    while item is not None:
        index, event = item
        new = index not in readers
        if new:
            readers[index] = ToolCallStream(reading.functions) if reading.functions is not None else None
        for part in _event_parts(reading, index, readers[index], event, first=new):
            yield part
        item = await next_event()


@dataclass(frozen=True)
class Call:
    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Answer:
    """A whole choice: its reasoning, content and calls, and how it ended."""

    index: int
    text: str  # the answer as written (calls and all)
    content: str | None  # the text that is not a call; None when the answer is calls only
    calls: tuple[Call, ...]
    reasoning: str | None  # None: the model does not reason
    logprobs: list[Entry] | None  # None: not asked
    finish_reason: str
    usage: dict[str, Any]
    stop_sequence: str | None


def _whole_answer(reading: Reading, index: int, texts: list[str], reasoning: list[str], entries: list[Entry],
                 event: TextEvent) -> Answer:
    """A finished choice, its calls read from the answer where functions were offered."""
    text = "".join(texts)
    content: str | None = text
    calls: tuple[Call, ...] = ()
    if reading.functions is not None:
        parsed = parse_tool_calls(text, reading.functions)
        content, found = parsed.content, parsed.calls
        if not found and event.finish_reason == "length":  # a call cut short is still a call
            content, found = read_calls(text, reading.functions)
        calls = tuple(Call(new_call_id(), c.name, c.arguments) for c in found)
    finish = finish_with_calls(event.finish_reason, bool(calls))
    assert finish is not None, "a whole answer has ended"
    return Answer(index, text, content if calls else text, calls, "".join(reasoning) if reading.reasoning else None,
                  entries if reading.logprobs else None, finish, event.usage or {},
                  None if calls else event.stop_sequence)


async def _collect_one(reading: Reading, index: int, generation: Generation) -> Answer:
    texts: list[str] = []
    reasoning: list[str] = []
    entries: list[Entry] = []
    async for event in generation.events():
        text, new = reading.first(event) if not texts else (event.text, event.logprobs)
        texts.append(text)
        reasoning.append(event.reasoning)
        entries += new
        if event.finish_reason is not None:
            return _whole_answer(reading, index, texts, reasoning, entries, event)
    raise AssertionError("events() ended without a finish reason")


async def collect(reading: Reading, generations: list[Generation]) -> list[Answer]:
    """The whole answers of a non-streamed request (its n choices together); `APIError` when one failed."""
    tasks = [asyncio.ensure_future(_collect_one(reading, i, g)) for i, g in enumerate(generations)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:  # one choice failed (or the client left): the others stop before their generations are released
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

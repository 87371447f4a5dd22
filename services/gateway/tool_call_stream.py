"""Tool calls streamed as they are generated: a call's name as soon as it is written, its arguments in pieces.

A streamed answer's text goes through `ToolCallStream`. Content goes out up to where a call may begin (a
`<tool_call>`, or part of one at the end of the text). Inside a Hermes block written as
`{"name": "f", "arguments": {...}}` (the order a forced call's grammar fixes, and the one models write),
the call's first delta carries its index and name once the name is whole and offered; then each piece of
the arguments object goes out as it comes, its end found by counting braces outside JSON strings. Calls
are numbered in order (parallel calls keep their indexes), and text after a call is not content.

What it cannot stream is held, then read whole at the end (tool_call_syntax.parse_tool_calls): a block
in another order or naming a function not offered, and a Llama 3.x JSON answer (one from its first
character). A block cut short (`max_tokens`) ends as the call it had become: name and arguments so far,
never its markup as content.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from services.gateway.tool_call_syntax import OPEN, PYTHON_TAG, Function, ToolCall, parse_tool_calls

_WS = " \t\r\n"


@dataclass(frozen=True)
class CallDelta:
    """A piece of call `index`: its first one names the function (`name`), later ones carry `arguments`."""

    index: int
    name: str | None
    arguments: str


class _Partial(Exception):
    """The text ends before the block's head could be read whole: wait for more (`name`: read so far)."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self.name = name


def _head(text: str, at: int) -> tuple[str, int] | None:
    """Read `{"name": "<f>", "arguments": {` from `at` (just after `<tool_call>`): (f, where the arguments'
    `{` is), or None when the block is written otherwise; `_Partial` when the text ends first."""
    name: str | None = None

    def literal(i: int | None, word: str) -> int | None:
        if i is None:
            return None
        while i < len(text) and text[i] in _WS:
            i += 1
        piece = text[i:i + len(word)]
        if not word.startswith(piece):
            return None
        if len(piece) < len(word):
            raise _Partial(name)
        return i + len(word)

    i = literal(literal(literal(literal(at, "{"), '"name"'), ":"), '"')
    if i is None:
        return None
    j = i
    while True:  # the name's closing quote: the first not escaped
        if j >= len(text):
            raise _Partial
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            break
        j += 1
    try:
        name = json.loads(text[i - 1:j + 1])
    except json.JSONDecodeError:
        return None
    k = literal(literal(literal(literal(j + 1, ","), '"arguments"'), ":"), "{")
    return (str(name), k - 1) if k is not None else None


class ToolCallStream:
    """One streamed answer's text in, (content, call deltas) out; `finish` once it is whole."""

    def __init__(self, functions: Sequence[Function]) -> None:
        self.functions = tuple(functions)
        self.names = {f.name for f in functions}
        self.text = ""
        self.at = 0  # how far the text is read (and, before the first call, let out as content)
        self.calls = 0  # calls begun: the next one's index
        self.depth = 0  # open braces of the arguments being read; 0 outside them
        self.in_string = self.escaped = False
        self.held = False  # a block it cannot stream, or a Llama 3.x JSON answer: read whole at the end

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """The content and call deltas that may go out now, after `text` came."""
        self.text += text
        content, deltas = "", []
        while not self.held and self.at < len(self.text):
            if self.depth:
                if piece := self._arguments():
                    deltas.append(CallDelta(self.calls - 1, None, piece))
                continue
            opened = self.text.find(OPEN, self.at)
            if opened < 0:
                if self.calls:  # text after a call is not content: skip to where another block may begin
                    self.at = max(self.at, len(self.text) - (len(OPEN) - 1))
                elif self._llama_json():
                    self.held = True
                elif (lead := self.text.lstrip()) and PYTHON_TAG.startswith(lead):
                    pass  # it may become a Llama 3.x tag, or a `<tool_call>`: wait
                else:
                    end = self._safe_end()
                    content, self.at = content + self.text[self.at:end], end
                break
            if not self.calls:
                content += self.text[self.at:opened]
            self.at = opened
            try:
                head = _head(self.text, opened + len(OPEN))
            except _Partial:
                break
            if head is None or head[0] not in self.names:
                self.held = True
                break
            name, self.at = head
            deltas.append(CallDelta(self.calls, name, ""))
            self.calls += 1
            if piece := self._arguments():
                deltas.append(CallDelta(self.calls - 1, None, piece))
        return content, deltas

    def take(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        """`feed`, and on the answer's last event (`final`) `finish` too."""
        content, deltas = self.feed(text)
        if final:
            rest, more = self.finish()
            content, deltas = content + rest, deltas + more
        return content, deltas

    def _llama_json(self) -> bool:
        """A Llama 3.x JSON answer: one from its first character (a JSON object, or the python tag)."""
        return self.text.lstrip().startswith(("{", PYTHON_TAG))

    def _safe_end(self) -> int:
        for k in range(min(len(OPEN) - 1, len(self.text) - self.at), 0, -1):  # a marker cut at the end
            if OPEN.startswith(self.text[-k:]):
                return len(self.text) - k
        return len(self.text)

    def _arguments(self) -> str:
        """The arguments' text from `at` on, up to their closing brace (which ends the call's arguments)."""
        start = i = self.at
        while i < len(self.text):
            c = self.text[i]
            i += 1
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (c == "\\", c != '"')
            elif c == '"':
                self.in_string = True
            elif c in "{}":
                self.depth += 1 if c == "{" else -1
                if self.depth == 0:
                    break
        self.at = i
        return self.text[start:i]

    def finish(self) -> tuple[str, list[CallDelta]]:
        """What is left once the answer is whole: content held back, and the calls not streamed, each in two
        deltas (its name, its arguments). A block cut inside its head is a call if its name was whole."""
        if not self.held:
            opened = self.text.find(OPEN, self.at)
            if opened < 0:
                rest = "" if self.calls else self.text[self.at:]
                self.at = len(self.text)
                return rest, []
            try:
                _head(self.text, opened + len(OPEN))
            except _Partial as cut:
                self.at = len(self.text)
                if cut.name in self.names:
                    self.calls += 1
                    return "", [CallDelta(self.calls - 1, cut.name, "")]
                return "", []
        parsed = parse_tool_calls(self.text, self.functions)
        rest = ""
        if not self.calls:
            rest = self.text[self.at:parsed.start] if parsed.calls else self.text[self.at:]
        deltas = []
        for call in parsed.calls[self.calls:]:  # those streamed come first in it
            deltas += [CallDelta(self.calls, call.name, ""), CallDelta(self.calls, None, call.arguments)]
            self.calls += 1
        self.at = len(self.text)
        return rest, deltas


def finish_with_calls(finish_reason: str | None, called: bool) -> str | None:
    """An answer's finish reason once it made calls: `tool_calls`, except a call cut by `max_tokens`, which
    stays `length` (as OpenAI's does); unchanged without calls, or before the answer ends (None)."""
    if not called or finish_reason in (None, "length"):
        return finish_reason
    return "tool_calls"


def read_calls(text: str, functions: Sequence[Function]) -> tuple[str | None, tuple[ToolCall, ...]]:
    """A finished answer's content and calls as a stream would have given them: a block cut short (by
    `max_tokens`) is a call with the arguments written so far (parse_tool_calls leaves it as text)."""
    content, deltas = ToolCallStream(functions).take(text, final=True)
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for d in deltas:
        if d.name is not None:
            names[d.index] = d.name
        arguments[d.index] = arguments.get(d.index, "") + d.arguments
    calls = tuple(ToolCall(names[k], arguments[k]) for k in sorted(names))
    return (content if content.strip() or not calls else None), calls

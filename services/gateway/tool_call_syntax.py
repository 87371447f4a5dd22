"""Tool calls in model text: parsing them out (`auto`), and the grammar that forces them (`required`, a name).

Two syntaxes, as vLLM's `hermes` and `llama3_json` parsers read them:
- Hermes (Qwen, Hermes, SmolLM, and AFlex's own tool prompt for templates that know no tools):
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call, after any text;
- Llama 3.x JSON: the whole answer is `{"name": "f", "parameters": {...}}` (optionally after
  `<|python_tag|>`), several separated by `;`.
A block that does not parse, or names a function the request did not offer, is left as text: a model
that writes about tool calls is not made to call one. The grammar is an llguidance Lark grammar whose
JSON parts are the functions' own JSON Schemas, so forced arguments always validate against them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)
# JSON as json.dumps writes it (the same layout as structured outputs: a small model may pad forever otherwise)
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Function:
    """One offered function: its name and the JSON Schema of its arguments (None: any object)."""

    name: str
    parameters: dict[str, Any] | None = None


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends `function.arguments`


@dataclass(frozen=True)
class Parsed:
    """A finished answer split into text and calls; `content` is None when only calls were written."""

    content: str | None
    calls: tuple[ToolCall, ...]
    start: int  # where the calls begin in the text (len(text) when there are none)


def _call(obj: Any, names: set[str], args_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    if not isinstance(args, dict):
        return None
    return ToolCall(str(obj["name"]), json.dumps(args, ensure_ascii=False))


def _hermes(text: str, names: set[str]) -> Parsed | None:
    matches = list(_HERMES.finditer(text))
    calls: list[ToolCall] = []
    for m in matches:
        try:
            call = _call(json.loads(m.group(1)), names, ("arguments", "parameters"))
        except json.JSONDecodeError:
            if m is matches[-1] and not m.group(0).rstrip().endswith(CLOSE) and calls:
                break  # the last block, cut short (max_tokens): the whole ones before it stand
            return None
        if call is None:
            return None
        calls.append(call)
    if not calls:
        return None
    start = matches[0].start()
    prefix = text[:start]
    return Parsed(prefix if prefix.strip() else None, tuple(calls), start)


def _llama_json(text: str, names: set[str]) -> Parsed | None:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return None
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    at = 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return None
        call = _call(obj, names, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return Parsed(None, tuple(calls), len(text) - len(text.lstrip()))


def parse_tool_calls(text: str, functions: Sequence[Function]) -> Parsed:
    """The calls to `functions` in a finished answer (Hermes blocks, or a Llama 3.x JSON answer)."""
    names = {f.name for f in functions}
    return _hermes(text, names) or _llama_json(text, names) or Parsed(text, (), len(text))


def call_lark(functions: Sequence[Function], parallel: bool = True, rule: str = "start",
              marker_ids: tuple[int, int] | None = None) -> str:
    """The lark text of one (or, `parallel`, one or more) Hermes call blocks to `functions`, in rule `rule` (a
    reasoning block may come before it); llguidance compiles it (answering._grammar).
    `marker_ids`: the ids of `<tool_call>` and `</tool_call>` where the vocabulary has them as tokens of
    their own (Qwen's): the grammar names those tokens, since llguidance will not spell an added token's text."""
    if not functions:
        raise ValueError("a forced tool call needs at least one function")
    bodies = [{"type": "object", "properties": {"name": {"const": f.name},
                                                "arguments": f.parameters or {"type": "object"}},
               "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    body = {"anyOf": bodies, "x-guidance": _LAYOUT}
    calls = 'call ("\\n" call)*' if parallel else "call"
    begin, end = json.dumps(OPEN + "\n"), json.dumps("\n" + CLOSE)
    if marker_ids is not None:
        begin, end = f'<[{marker_ids[0]}]> "\\n"', f'"\\n" <[{marker_ids[1]}]>'
    return f"{rule}: {calls}\ncall: {begin} %json {json.dumps(body)} {end}\n"


def hermes_block(call: ToolCall) -> str:
    """A call as the Hermes syntax writes it (the tool prompt's rendering of an earlier assistant call)."""
    return f'{OPEN}\n{{"name": {json.dumps(call.name)}, "arguments": {call.arguments}}}\n{CLOSE}'

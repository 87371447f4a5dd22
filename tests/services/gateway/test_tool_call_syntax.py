"""Reading tool calls out of model text (Hermes blocks, Llama 3.x JSON), streamed and whole, and the grammar
that forces them, checked on SmolLM2's real vocabulary."""

from __future__ import annotations

import json

import llguidance
import pytest

from services.gateway.tool_call_stream import CallDelta, ToolCallStream, read_calls
from services.gateway.tool_call_syntax import (
    Function,
    ToolCall,
    call_lark,
    hermes_block,
    parse_tool_calls,
)
from shared.model import structured
from shared.model.checkpoint import open_model_card
from shared.model.tokenizer import Tokenizer

WEATHER = Function("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"]})
TIME = Function("get_time", None)
FUNCTIONS = (WEATHER, TIME)
PARIS = ToolCall("get_weather", '{"city": "Paris"}')


@pytest.mark.parametrize(("text", "content", "calls"), [
    (hermes_block(PARIS), None, (PARIS,)),
    ("Let me check.\n" + hermes_block(PARIS) + "\n" + hermes_block(ToolCall("get_time", "{}")),
     "Let me check.\n", (PARIS, ToolCall("get_time", "{}"))),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', None, (PARIS,)),  # no closing tag
    (hermes_block(PARIS) + '\n<tool_call>\n{"name": "get_time", "argu', None, (PARIS,)),  # the last cut short
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, (PARIS,)),  # Llama 3.x JSON
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
     None, (PARIS, ToolCall("get_time", "{}"))),
])
def test_calls_are_parsed(text: str, content: str | None, calls: tuple[ToolCall, ...]) -> None:
    parsed = parse_tool_calls(text, FUNCTIONS)
    assert (parsed.content, parsed.calls) == (content, calls)


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',  # not an offered function
    "<tool_call>\nnot json\n</tool_call>",
    '{"answer": 42}',  # JSON content, no call
    '{"name": "get_weather", "parameters": {"city": "Paris"}} and then some prose',
])
def test_text_that_is_not_a_call_stays_text(text: str) -> None:
    parsed = parse_tool_calls(text, FUNCTIONS)
    assert parsed.calls == () and parsed.content == text


def _streamed(pieces: list[str]) -> tuple[list[str], str, tuple[ToolCall, ...], list[list[CallDelta]]]:
    """Content per piece, content at the end, the calls the deltas make up, and the deltas per piece (the
    end's last)."""
    reader = ToolCallStream(FUNCTIONS)
    fed = [reader.feed(p) for p in pieces]
    rest, last = reader.finish()
    deltas = [d for _, d in fed] + [last]
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for d in (d for ds in deltas for d in ds):
        names[d.index] = d.name if d.name is not None else names[d.index]
        arguments[d.index] = arguments.get(d.index, "") + d.arguments
    calls = tuple(ToolCall(names[k], arguments[k]) for k in sorted(names))
    return [c for c, _ in fed], rest, calls, deltas


def _pieces(text: str, size: int) -> list[str]:
    return [text[k:k + size] for k in range(0, len(text), size)]


def test_a_stream_lets_out_text_but_never_call_syntax() -> None:
    tail = hermes_block(PARIS)[len("<tool_"):]
    pieces = ["Sure", ", one moment. <to", "ol_", *_pieces(tail, 5)]
    out, rest, calls, _ = _streamed(pieces)
    assert "".join(out) + rest == "Sure, one moment. " and calls == (PARIS,)
    assert out[1] == ", one moment. "  # held back only from the cut marker on
    out, rest, calls, _ = _streamed(['{"name": "get_weather", ', '"parameters": {"city": "Paris"}}'])
    assert out == ["", ""] and rest == "" and calls == (PARIS,)  # Llama 3.x JSON: whole, at the end
    out, rest, calls, _ = _streamed(["a < b", " and {x}"])  # not a call: all of it, in order
    assert "".join(out) + rest == "a < b and {x}" and calls == ()
    out, rest, calls, _ = _streamed(['{"answer": ', "42}"])  # held (it might have been a call), then let out
    assert "".join(out) + rest == '{"answer": 42}' and calls == ()


def test_a_call_streams_its_name_first_then_its_arguments_as_they_come() -> None:
    text = "Checking. " + hermes_block(ToolCall("get_weather", '{"city": "Pa\\"ris {x}"}')) + "\n" + hermes_block(
        ToolCall("get_time", "{}"))
    out, rest, calls, deltas = _streamed(_pieces(text, 3))
    assert "".join(out) + rest == "Checking. "
    assert calls == (ToolCall("get_weather", '{"city": "Pa\\"ris {x}"}'), ToolCall("get_time", "{}"))
    firsts = [d for ds in deltas for d in ds if d.name is not None]
    assert [(d.index, d.name) for d in firsts] == [(0, "get_weather"), (1, "get_time")]
    named_at = next(k for k, ds in enumerate(deltas) if any(d.name == "get_weather" for d in ds))
    pieces = [k for k, ds in enumerate(deltas) for d in ds if d.index == 0 and d.name is None and d.arguments]
    assert len(pieces) > 3 and min(pieces) >= named_at and max(pieces) < len(deltas) - 1  # as they came
    assert json.loads(calls[0].arguments) == {"city": 'Pa"ris {x}'}  # braces and quotes inside the string


@pytest.mark.parametrize(("text", "call"), [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', ToolCall("get_weather", '{"city": "Par')),
    ('<tool_call>\n{"name": "get_weather", "argu', ToolCall("get_weather", "")),  # the name whole: a call
])
def test_a_call_cut_short_is_a_call_never_markup(text: str, call: ToolCall) -> None:
    out, rest, calls, _ = _streamed(_pieces(text, 4))
    assert "".join(out) + rest == "" and calls == (call,)
    assert read_calls(text, FUNCTIONS) == (None, (call,))
    out, rest, calls, _ = _streamed(_pieces('Hm. <tool_call>\n{"name": "get_wea', 4))  # not even its name
    assert "".join(out) + rest == "Hm. " and calls == ()
    out, rest, calls, _ = _streamed(["<", "tool", "_call", ">\n", '{"', "name"])  # "<" might have been <|python_tag|>
    assert "".join(out) + rest == "" and calls == ()


def test_blocks_it_cannot_stream_are_read_whole_at_the_end() -> None:
    reordered = '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>'
    out, rest, calls, deltas = _streamed(_pieces(reordered, 5))
    assert calls == (PARIS,) and not any(deltas[:-1]) and "".join(out) + rest == ""
    unknown = '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>'
    out, rest, calls, _ = _streamed(_pieces(unknown, 5))
    assert calls == () and "".join(out) + rest == unknown  # not an offered function: text, as whole


Vocabulary = tuple[Tokenizer, llguidance.LLTokenizer]


@pytest.fixture(scope="module")
def vocabulary() -> Vocabulary:
    card = open_model_card("default")
    assert card.tokenizer is not None
    return card.tokenizer, structured.llg_tokenizer(card.tokenizer, card.args.vocab_size)


def _accepts(vocabulary: Vocabulary, grammar: str, text: str) -> bool:
    tokenizer, llg = vocabulary
    ids = tokenizer.encode(text, False)
    matcher = llguidance.LLMatcher(llg, grammar)
    return bool(matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting())


def call_grammar(functions: list[Function], parallel: bool = True) -> str:
    """A forced call's grammar, compiled as the gateway compiles it (answering._grammar)."""
    return str(llguidance.LLMatcher.grammar_from_lark(call_lark(functions, parallel)))


def test_the_grammar_takes_exactly_calls_to_the_offered_functions(vocabulary: Vocabulary) -> None:
    any_call = call_grammar(FUNCTIONS, parallel=True)
    structured.check(any_call, vocabulary[1], "tools")
    two = hermes_block(PARIS) + "\n" + hermes_block(ToolCall("get_time", '{"tz": "UTC"}'))
    assert _accepts(vocabulary, any_call, hermes_block(PARIS))
    assert _accepts(vocabulary, any_call, two)
    one = call_grammar(FUNCTIONS, parallel=False)
    assert not _accepts(vocabulary, one, two)
    assert not _accepts(vocabulary, any_call, hermes_block(ToolCall("get_weather", '{"city": 3}')))
    assert not _accepts(vocabulary, any_call, hermes_block(ToolCall("other", "{}")))
    assert not _accepts(vocabulary, any_call, "Sure! " + hermes_block(PARIS))
    only_time = call_grammar([TIME])
    assert not _accepts(vocabulary, only_time, hermes_block(PARIS))
    with pytest.raises(ValueError, match="at least one function"):
        call_grammar([])
    assert json.loads(PARIS.arguments) == {"city": "Paris"}

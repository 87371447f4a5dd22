"""Tool calling through the whole mesh with the official `openai` client: a forced call's arguments always
validate against the function's schema, and the round trip (call, tool result, final answer) works streamed
and not. The tiny random checkpoint carries SmolLM2's real tokenizer and template, which knows no tools, so
AFlex's Hermes tool prompt renders them; `auto` is checked on text a model could write (parsing is unit-tested).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
}, "required": ["city", "days"], "additionalProperties": False}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def client(chat_client: openai.OpenAI) -> openai.OpenAI:
    return chat_client


def test_required_tool_calls_validate_over_20_seeded_samples(client: openai.OpenAI, chat_model: str) -> None:
    """The random model writes nothing like a call on its own; the tools' grammar makes every answer one."""
    seen = set()
    for seed in range(20):
        choice = client.chat.completions.create(model=chat_model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, max_tokens=120, seed=seed,
                                                temperature=1.0).choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        assert choice.message.content is None
        calls = choice.message.tool_calls or []
        assert len(calls) == 1
        call = calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        seen.add((call.function.name, call.function.arguments))
    assert len(seen) > 1  # sampled, not one forced answer


def test_a_named_function_is_the_one_called(client: openai.OpenAI, chat_model: str) -> None:
    choice = client.chat.completions.create(
        model=chat_model, messages=ASK, tools=TOOLS, max_tokens=120, seed=4, temperature=1.0,
        tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
    calls: list[Any] = list(choice.message.tool_calls or [])
    assert calls and all(c.function.name == "get_time" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS["get_time"])


def _streamed_calls(chunks: Any) -> tuple[list[Any], str | None, list[list[Any]]]:
    """A stream's calls put together from their deltas (OpenAI's way: a call's first delta has its id, type and
    name, later ones add to its arguments), its finish reason, and each call's deltas. No content goes out."""
    deltas: dict[int, list[Any]] = {}
    finish = None
    for chunk in chunks:
        for c in chunk.choices:
            assert not c.delta.content  # no call syntax leaks out as text
            for d in c.delta.tool_calls or []:
                deltas.setdefault(d.index, []).append(d)
            finish = c.finish_reason or finish
    calls = []
    for index in sorted(deltas):
        first, *rest = deltas[index]
        assert first.id and first.type == "function" and first.function.name  # the name in the first delta
        assert all(d.id is None and d.function.name is None for d in rest)
        arguments = "".join(d.function.arguments or "" for d in deltas[index])
        calls.append(openai.types.chat.ChatCompletionMessageToolCall(
            id=first.id, type="function", function={"name": first.function.name, "arguments": arguments}))
    return calls, finish, [deltas[k] for k in sorted(deltas)]


def test_50_streamed_required_calls_name_first_arguments_as_they_come(client: openai.OpenAI, chat_model: str
                                                                      ) -> None:
    """`max_tokens` from 8 to 57 cuts some calls short: those end `length` with the call so far, never its
    markup as content; the whole ones end `tool_calls` and their arguments validate against the schema."""
    cut = whole = 0
    for seed in range(50):
        calls, finish, deltas = _streamed_calls(client.chat.completions.create(
            model=chat_model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=8 + seed, seed=seed, temperature=1.0, stream=True))
        if finish == "length":
            cut += 1
            continue
        assert finish == "tool_calls" and len(calls) == 1, (finish, calls)
        whole += 1
        jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])
        assert len([d for d in deltas[0] if d.function.arguments]) > 1  # in pieces, as the tokens came
    assert cut and whole, (cut, whole)


def _round_trip(client: openai.OpenAI, model: str, stream: bool) -> tuple[Any, str, str | None]:
    """(the call, the final answer's text, its finish reason), streamed or not."""
    kw: Any = {"model": model, "tools": TOOLS, "max_tokens": 120, "seed": 7, "temperature": 1.0}
    if stream:
        calls, finish, _ = _streamed_calls(client.chat.completions.create(
            messages=ASK, tool_choice="required", parallel_tool_calls=False, stream=True, **kw))
        assert finish == "tool_calls" and len(calls) == 1
        call = calls[0]
    else:
        first = client.chat.completions.create(messages=ASK, tool_choice="required", parallel_tool_calls=False, **kw)
        assert first.choices[0].finish_reason == "tool_calls"
        call = (first.choices[0].message.tool_calls or [])[0]
    assert call.function and call.function.name and call.function.arguments is not None
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    history: Any = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny", "high_c": 21})}]
    if not stream:
        final = client.chat.completions.create(messages=history, tool_choice="none", **kw).choices[0]
        return call, final.message.content or "", final.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(messages=history, tool_choice="none", stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return call, text, finish


@pytest.mark.parametrize("stream", [False, True])
def test_the_round_trip_call_result_answer(client: openai.OpenAI, chat_model: str, stream: bool) -> None:
    call, text, finish = _round_trip(client, chat_model, stream)
    assert finish in ("stop", "length") and text
    again = _round_trip(client, chat_model, stream)  # seeded: the same call and answer
    assert (again[0].function.arguments, again[1]) == (call.function.arguments, text)


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests_are_400s(client: openai.OpenAI, chat_model: str, body: Any, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=chat_model, messages=ASK, max_tokens=4,
                                       extra_body=body)
    assert info.value.body["param"] == param  # type: ignore[index]

"""`POST /v1/responses` through the whole mesh with the official `openai` client: text, the event stream,
function tools and their round trip, JSON-schema text, and the 400s of what a stateless server cannot do."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS: Any = [{"type": "function", "name": "get_weather", "description": "Forecast", "parameters": WEATHER,
               "strict": True}]
GREEDY: Any = {"max_output_tokens": 12, "temperature": 0.0}


@pytest.fixture(scope="module")
def client(chat_client: openai.OpenAI) -> openai.OpenAI:
    return chat_client


def test_text_is_the_chat_completions_answer_and_streams_the_same(client: openai.OpenAI, chat_model: str) -> None:
    response = client.responses.create(model=chat_model, instructions="Be brief.", input="Name a colour.", **GREEDY)
    chat = client.chat.completions.create(model=chat_model, max_completion_tokens=12, temperature=0.0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}])
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage is not None and response.usage.output_tokens == chat.usage.completion_tokens  # type: ignore
    assert response.usage.input_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]
    assert (response.usage.model_extra or {})["energy_j"] > 0
    kinds, deltas, final = [], "", None
    for event in client.responses.create(model=chat_model, instructions="Be brief.", input="Name a colour.",
                                         stream=True, **GREEDY):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if response.status == "completed" else "response.incomplete"]
    assert final is not None and deltas == final.output_text == response.output_text


def test_a_function_call_and_its_output_round_trip(client: openai.OpenAI, chat_model: str) -> None:
    first = client.responses.create(model=chat_model, input="Weather in Paris?", tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=60, temperature=1.0,
                                    extra_body={"seed": 3})
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    streamed = [e for e in client.responses.create(model=chat_model, input="Weather in Paris?", tools=TOOLS,
                                                   tool_choice="required", parallel_tool_calls=False,
                                                   max_output_tokens=60, temperature=1.0, extra_body={"seed": 3},
                                                   stream=True)]
    done = [e.arguments for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done == [calls[0].arguments]  # seeded: the same call, streamed
    pieces = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == done[0]  # the arguments as they were generated
    added = next(e for e in streamed if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather" and not added.item.arguments
    assert streamed.index(added) < streamed.index(next(e for e in streamed if e.type.endswith("arguments.delta")))
    assert not [e for e in streamed if e.type == "response.output_text.delta"]  # no call syntax as text
    history: Any = [{"role": "user", "content": "Weather in Paris?"},
                    {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                     "arguments": calls[0].arguments},
                    {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "sunny"}'}]
    final = client.responses.create(model=chat_model, input=history, tools=TOOLS, tool_choice="none", **GREEDY)
    assert final.output_text and not [item for item in final.output if item.type == "function_call"]


def test_json_schema_text(client: openai.OpenAI, chat_model: str) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    response = client.responses.create(model=chat_model, input="Yes or no?", max_output_tokens=40,
                                       text={"format": {"type": "json_schema", "name": "reply", "schema": schema}})
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize(("body", "param"), [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
])
def test_what_a_stateless_server_cannot_serve_is_a_400(client: openai.OpenAI, chat_model: str, body: Any,
                                                       param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=chat_model, input="x", max_output_tokens=4, extra_body=body)
    assert info.value.body["param"] == param  # type: ignore[index]

"""`POST /v1/messages` (Anthropic's Messages API) through the whole mesh with the official `anthropic` client:
text equal to the chat completion of the same conversation, the event stream, `stop_sequences`, a tool round trip
(tool_use, tool_result, final answer) whole and streamed with the input as it is generated, count_tokens,
and errors in Anthropic's shape."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tools.launch import Mesh

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS: Any = [{"name": "get_weather", "description": "Forecast", "input_schema": WEATHER}]
ASK: Any = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY: Any = {"temperature": 0.0}  # not in this client's signature (the API still takes it)


@pytest.fixture(scope="module")
def claude(chat_mesh: Mesh) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=chat_mesh.base_url.removesuffix("/v1"), api_key="unused", max_retries=0)


def test_text_is_the_chat_answer_and_streams_the_same(claude: anthropic.Anthropic, chat_client: openai.OpenAI,
                                                       chat_model: str) -> None:
    message = claude.messages.create(model=chat_model, system="Be brief.", max_tokens=12, extra_body=GREEDY,
                                     messages=[{"role": "user", "content": "Name a colour."}])
    chat = chat_client.chat.completions.create(model=chat_model, max_completion_tokens=12, extra_body=GREEDY, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}])
    assert message.id.startswith("msg_") and message.role == "assistant" and message.type == "message"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert chat.usage is not None and message.usage.output_tokens == chat.usage.completion_tokens
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
    assert message.usage.cache_read_input_tokens is not None and (message.usage.model_extra or {})["energy_j"] > 0
    with claude.messages.stream(model=chat_model, system="Be brief.", max_tokens=12, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Name a colour."}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in message.content]  # type: ignore[union-attr]
    assert final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens


def test_a_stop_sequence_is_named(claude: anthropic.Anthropic, chat_model: str) -> None:
    free = claude.messages.create(model=chat_model, max_tokens=24, extra_body=GREEDY, messages=ASK)
    text = free.content[0].text  # type: ignore[union-attr]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = claude.messages.create(model=chat_model, max_tokens=24, extra_body=GREEDY, messages=ASK,
                                 stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text.startswith(cut.content[0].text) and stop not in cut.content[0].text  # type: ignore[union-attr]


def test_a_tool_round_trip_whole_and_streamed(claude: anthropic.Anthropic, chat_model: str) -> None:
    kw: Any = {"model": chat_model, "tools": TOOLS, "max_tokens": 120, "extra_body": {"temperature": 1.0, "seed": 3},
               "messages": ASK, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    first = claude.messages.create(**kw)
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]
    call = first.content[0]
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)
    with claude.messages.stream(**kw) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert streamed.content[0].input == call.input  # type: ignore[union-attr]  # seeded: the same call
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"
              and e.delta.type == "input_json_delta"]
    assert len(pieces) > 1 and streamed.stop_reason == "tool_use"  # the input as it was generated
    assert streamed.content[0].type == "tool_use" and streamed.content[0].name == "get_weather"
    jsonschema.validate(streamed.content[0].input, WEATHER)
    history: Any = [*ASK, {"role": "assistant", "content": [call.model_dump()]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                  "content": json.dumps({"sky": "sunny"})}]}]
    final = claude.messages.create(model=chat_model, tools=TOOLS, max_tokens=12, extra_body=GREEDY, messages=history,
                                   tool_choice={"type": "none"})
    assert final.content and final.content[0].type == "text" and final.stop_reason in ("end_turn", "max_tokens")


def test_count_tokens_is_the_prompt_a_message_is_charged(claude: anthropic.Anthropic, chat_model: str) -> None:
    """Usage in Anthropic's terms: `input_tokens` leaves out the cache reads, and the two add up to the prompt
    (as Anthropic's clients add them), whole and streamed, with and without a cache hit."""
    messages: Any = [{"role": "user", "content": "Count the tokens of this exact question, please: " * 8}]
    counted = claude.messages.count_tokens(model=chat_model, messages=messages, tools=TOOLS)
    first = claude.messages.create(model=chat_model, max_tokens=1, messages=messages, tools=TOOLS)
    again = claude.messages.create(model=chat_model, max_tokens=1, messages=messages, tools=TOOLS)
    with claude.messages.stream(model=chat_model, max_tokens=1, messages=messages, tools=TOOLS) as stream:
        streamed = stream.get_final_message()
    for message in (first, again, streamed):
        assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == counted.input_tokens
    for message in (again, streamed):  # the question's own blocks were cached by the first
        assert (message.usage.cache_read_input_tokens or 0) > (first.usage.cache_read_input_tokens or 0)
        assert 0 < message.usage.input_tokens < counted.input_tokens


@pytest.mark.parametrize(("body", "words"), [
    ({"messages": ASK}, "max_tokens"),  # required
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 8}, "image"),
    ({"messages": ASK, "max_tokens": 8, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "server tools"),
])
def test_bad_requests_are_400s_in_anthropics_shape(claude: anthropic.Anthropic, chat_model: str, body: Any,
                                                   words: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.post("/v1/messages", body={"model": chat_model, **body}, cast_to=dict)
    error = caught.value.body
    assert isinstance(error, dict) and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error" and words in error["error"]["message"]

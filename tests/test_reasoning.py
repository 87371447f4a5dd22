"""Reasoning models through all three APIs, on a tiny Qwen3 taught to reason (tests/reasoning_model.py).

Every answer is checked against the mesh's own raw completion of the same prompt: the reasoning is the text
inside `<think>...</think>`, the answer the text after it, and neither carries a marker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from shared.model.tokenizer import Tokenizer
from tests.conftest import TEST_DATA
from tests.reasoning_model import QUESTION, WEATHER_QUESTION, WEATHER_TOOL
from tests.stream_replay import REASONING_CASES, replay
from tools.launch import Mesh, aflex_up

MAX_TOKENS = 60


@pytest.fixture(scope="module")
def mesh(reasoning_checkpoint: Path) -> Iterator[Mesh]:
    with aflex_up(str(reasoning_checkpoint)) as running:
        yield running


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def raw(mesh: Mesh, client: openai.OpenAI, reasoning_checkpoint: Path) -> Any:
    """The model's whole text for a conversation, markers included: a greedy completion of its prompt as the
    template renders it."""
    tokenizer = Tokenizer.from_hf_dir(reasoning_checkpoint)
    assert tokenizer is not None

    def complete(messages: list[dict[str, Any]], **variables: Any) -> str:
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, **variables))
        answer = client.completions.create(model=mesh.served_model(), prompt=prompt_ids, max_tokens=MAX_TOKENS,
                                           temperature=0)
        assert answer.choices[0].finish_reason == "stop"
        return answer.choices[0].text

    return complete


def _split(text: str) -> tuple[str, str]:
    """(reasoning, answer) of a raw text that opens with a reasoning block."""
    assert text.startswith("<think>"), text
    reasoning, _, answer = text.removeprefix("<think>").partition("</think>")
    return reasoning.strip("\n"), answer.lstrip("\n")


def _chat(client: openai.OpenAI, mesh: Mesh, messages: list[dict[str, Any]], **fields: Any) -> Any:
    return client.chat.completions.create(model=mesh.served_model(), messages=messages,  # type: ignore[arg-type]
                                          temperature=0, max_tokens=MAX_TOKENS, **fields)


def _stream(client: openai.OpenAI, mesh: Mesh, messages: list[dict[str, Any]],
            **fields: Any) -> list[dict[str, Any]]:
    """The streamed deltas, in order, each as a dict with its finish_reason."""
    chunks = _chat(client, mesh, messages, stream=True, stream_options={"include_usage": True}, **fields)
    out = []
    for chunk in chunks:
        if chunk.choices:
            out.append({**chunk.choices[0].delta.model_dump(exclude_none=True),
                        "finish_reason": chunk.choices[0].finish_reason})
        else:
            out.append({"usage": chunk.usage})
    return out


def test_chat_reasoning_comes_apart_from_the_answer(client: openai.OpenAI, mesh: Mesh, raw: Any) -> None:
    reasoning, answer = _split(raw(QUESTION))
    assert reasoning and answer and "<think>" not in answer + reasoning
    whole = _chat(client, mesh, QUESTION)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (reasoning, answer)  # type: ignore[attr-defined]
    details = whole.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < whole.usage.completion_tokens

    deltas = _stream(client, mesh, QUESTION)
    kinds = [("reasoning" if "reasoning_content" in d else "content") for d in deltas
             if d.get("reasoning_content") or d.get("content")]
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # all reasoning first, then the answer
    assert kinds.count("reasoning") > 1  # streamed as it came, not in one piece
    assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
    assert "".join(d.get("content") or "" for d in deltas) == answer
    assert deltas[-2]["finish_reason"] == "stop"
    assert deltas[-1]["usage"].completion_tokens_details.reasoning_tokens == details.reasoning_tokens


@pytest.mark.parametrize("switch", [{"reasoning_effort": "none"},
                                    {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}])
def test_thinking_turned_off_gives_no_reasoning(client: openai.OpenAI, mesh: Mesh, raw: Any,
                                                switch: dict[str, Any]) -> None:
    answer = raw(QUESTION, enable_thinking=False)
    assert answer and "think>" not in answer
    message = _chat(client, mesh, QUESTION, **switch).choices[0].message
    assert (message.reasoning_content, message.content) == (None, answer)  # type: ignore[attr-defined]
    deltas = _stream(client, mesh, QUESTION, **switch)
    assert not any("reasoning_content" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == answer


def test_max_tokens_counts_reasoning_and_answer(client: openai.OpenAI, mesh: Mesh, raw: Any) -> None:
    reasoning, _ = _split(raw(QUESTION))
    cut = client.chat.completions.create(model=mesh.served_model(), messages=QUESTION,  # type: ignore[arg-type]
                                         temperature=0, max_tokens=4)
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and cut.usage.completion_tokens == 4
    assert choice.message.content is None
    assert choice.message.reasoning_content and reasoning.startswith(choice.message.reasoning_content)  # type: ignore[attr-defined]


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_a_tool_call_after_reasoning_streams_name_first(client: openai.OpenAI, mesh: Mesh, raw: Any,
                                                        tool_choice: str) -> None:
    reasoning, answer = _split(raw(WEATHER_QUESTION, tools=[WEATHER_TOOL]))
    expected = json.loads(answer.removeprefix("<tool_call>").removesuffix("</tool_call>"))
    deltas = _stream(client, mesh, WEATHER_QUESTION, tools=[WEATHER_TOOL], tool_choice=tool_choice)
    calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
    assert not any(d.get("content") for d in deltas)  # no call markup as text
    first_call = next(k for k, d in enumerate(deltas) if d.get("tool_calls"))
    assert not any("reasoning_content" in d for d in deltas[first_call:])
    assert calls[0]["function"]["name"] == expected["name"] and calls[0]["id"]
    assert len(calls) > 2  # the arguments came in pieces
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == expected["arguments"]
    assert deltas[-2]["finish_reason"] == "tool_calls"


def test_responses_reasoning_items(client: openai.OpenAI, mesh: Mesh, raw: Any) -> None:
    reasoning, answer = _split(raw(QUESTION))
    text = QUESTION[0]["content"]
    whole = client.responses.create(model=mesh.served_model(), input=text, temperature=0, store=False)
    kinds = [item.type for item in whole.output]
    assert kinds == ["reasoning", "message"]
    assert whole.output[0].content[0].text == reasoning  # type: ignore[union-attr,index]
    assert whole.output_text == answer
    assert whole.usage is not None and whole.usage.output_tokens_details.reasoning_tokens > 0

    events = list(client.responses.create(model=mesh.served_model(), input=text, temperature=0, store=False,
                                          stream=True))
    deltas = [(e.type, e.delta) for e in events if e.type.endswith("_text.delta")]  # type: ignore[union-attr]
    assert [t for t, _ in deltas] == sorted((t for t, _ in deltas), key=lambda t: "output_text" in t)
    assert "".join(d for t, d in deltas if t == "response.reasoning_text.delta") == reasoning
    assert "".join(d for t, d in deltas if t == "response.output_text.delta") == answer
    done = events[-1].response  # type: ignore[union-attr]
    assert [item.type for item in done.output] == kinds and done.output_text == answer

    off = client.responses.create(model=mesh.served_model(), input=text, temperature=0, store=False,
                                  reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["message"]
    assert off.output_text == raw(QUESTION, enable_thinking=False)


def test_messages_thinking_blocks(mesh: Mesh, raw: Any) -> None:
    reasoning, answer = _split(raw(QUESTION))
    client = anthropic.Anthropic(base_url=mesh.base_url.removesuffix("/v1"), api_key="unused", max_retries=0)
    fields: dict[str, Any] = {"model": mesh.served_model(), "max_tokens": MAX_TOKENS, "messages": QUESTION,
                              "extra_body": {"temperature": 0}}
    whole = client.messages.create(**fields)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == reasoning and whole.content[1].text == answer  # type: ignore[union-attr]

    with client.messages.stream(**fields) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds == sorted(kinds, key=lambda k: k == "text_delta") and kinds.count("thinking_delta") > 1
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == reasoning and final.content[1].text == answer  # type: ignore[union-attr]

    off = client.messages.create(**fields, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == raw(QUESTION, enable_thinking=False)  # type: ignore[union-attr]

    tool = {"name": "get_weather", "description": WEATHER_TOOL["function"]["description"],  # type: ignore[index]
            "input_schema": WEATHER_TOOL["function"]["parameters"]}  # type: ignore[index]
    called = client.messages.create(**{**fields, "messages": WEATHER_QUESTION}, tools=[tool],
                                    tool_choice={"type": "any"})
    _, answer = _split(raw(WEATHER_QUESTION, tools=[WEATHER_TOOL]))
    expected = json.loads(answer.removeprefix("<tool_call>").removesuffix("</tool_call>"))
    assert [b.type for b in called.content] == ["thinking", "tool_use"] and called.stop_reason == "tool_use"
    assert (called.content[1].name, called.content[1].input) == (expected["name"], expected["arguments"])  # type: ignore[union-attr]


def test_the_recorded_reasoning_answers_come_again(mesh: Mesh) -> None:
    """Whole and streamed, every API, byte for byte as recorded (ids, times and joules aside)."""
    differ = replay(TEST_DATA / "streams" / "reasoning_model.json", mesh.base_url.removesuffix("/v1"),
                    mesh.served_model(), REASONING_CASES)
    assert not differ, differ[:2]

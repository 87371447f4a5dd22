"""A recorded set of requests to every API, whole and streamed, and the answers' bytes as the gateway sent them.

The gateway's answer path (one part stream, a renderer per API) must send what it sent before, byte for
byte, but for what differs on every run: ids, times and joules. `record` writes the answers of a mesh to a
JSON file (`AFLEX_RECORD_STREAMS=1 pytest tests/test_stream_replay.py tests/test_reasoning.py -k replay`);
`replay` asks the same requests again and returns (case, recorded, now) for each answer that differs.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import httpx2 as httpx

RECORDING = os.environ.get("AFLEX_RECORD_STREAMS") == "1"

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
           "required": ["city"], "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                                 "parameters": WEATHER}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Forecast", "parameters": WEATHER}]
MESSAGES_TOOLS = [{"name": "get_weather", "description": "Forecast", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 1.0, "seed": 7}

# (name, path, body) of the plain chat model's cases; each is asked whole and streamed
CHAT_CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("chat-greedy", "/v1/chat/completions", {"messages": ASK, "max_tokens": 12, **GREEDY}),
    ("chat-n2-logprobs", "/v1/chat/completions", {"messages": ASK, "max_tokens": 8, "n": 2, "logprobs": True,
                                                  "top_logprobs": 2, **SEEDED}),
    ("chat-stop", "/v1/chat/completions", {"messages": ASK, "max_tokens": 24, "stop": ["e", "a"], **GREEDY}),
    ("chat-tools-auto", "/v1/chat/completions", {"messages": ASK, "max_tokens": 10, "tools": CHAT_TOOLS, **GREEDY}),
    ("chat-tools-required", "/v1/chat/completions", {"messages": ASK, "max_tokens": 60, "tools": CHAT_TOOLS,
                                                     "tool_choice": "required", **SEEDED}),
    ("chat-tools-parallel", "/v1/chat/completions", {"messages": ASK, "max_tokens": 90, "tools": CHAT_TOOLS,
                                                     "tool_choice": "required", "parallel_tool_calls": True,
                                                     "temperature": 1.0, "seed": 11}),
    ("chat-call-cut", "/v1/chat/completions", {"messages": ASK, "max_tokens": 9, "tools": CHAT_TOOLS,
                                               "tool_choice": {"type": "function",
                                                               "function": {"name": "get_weather"}}, **SEEDED}),
    ("chat-json", "/v1/chat/completions", {"messages": ASK, "max_tokens": 16,
                                           "response_format": {"type": "json_object"}, **SEEDED}),
    ("completion-echo", "/v1/completions", {"prompt": "The sky is", "max_tokens": 6, "echo": True, "logprobs": 1,
                                            **GREEDY}),
    ("completion-n2-ids", "/v1/completions", {"prompt": [1, 504, 3162], "max_tokens": 5, "n": 2, "stop": " ",
                                              **SEEDED}),
    ("responses-plain", "/v1/responses", {"input": "Weather in Paris?", "instructions": "Be brief.",
                                          "max_output_tokens": 10, **GREEDY}),
    ("responses-tools", "/v1/responses", {"input": ASK, "max_output_tokens": 60, "tools": RESPONSES_TOOLS,
                                          "tool_choice": "required", **SEEDED}),
    ("responses-call-cut", "/v1/responses", {"input": ASK, "max_output_tokens": 9, "tools": RESPONSES_TOOLS,
                                             "tool_choice": "required", **SEEDED}),
    ("messages-plain", "/v1/messages", {"messages": ASK, "system": "Be brief.", "max_tokens": 10, **GREEDY}),
    ("messages-stop", "/v1/messages", {"messages": ASK, "max_tokens": 24, "stop_sequences": ["e"], **GREEDY}),
    ("messages-tools", "/v1/messages", {"messages": ASK, "max_tokens": 60, "tools": MESSAGES_TOOLS,
                                        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                                        **SEEDED}),
    ("messages-call-cut", "/v1/messages", {"messages": ASK, "max_tokens": 9, "tools": MESSAGES_TOOLS,
                                           "tool_choice": {"type": "any"}, **SEEDED}),
]

# conversations with history: earlier calls, their results and reasoning, in each API's own shape
_CALL_ARGS = '{"city": "Paris"}'
_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": _CALL_ARGS}}
CHAT_HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
                {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "Rome?"}]}]
RESPONSES_HISTORY = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
                     {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Ask the tool."}]},
                     {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": _CALL_ARGS},
                     {"type": "function_call_output", "call_id": "call_1", "output": {"sky": "sunny"}},
                     {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
                     {"role": "user", "content": "And Rome?"}]
_THOUGHT = {"type": "thinking", "thinking": "Ask the tool.", "signature": ""}
MESSAGES_HISTORY = [{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": [_THOUGHT,
                                                      {"type": "text", "text": "Let me look."},
                                                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                       "input": {"city": "Paris"}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                  "content": [{"type": "text", "text": '{"sky": "sunny"}'}]},
                                                 {"type": "text", "text": "And Rome?"}]}]
CHAT_CASES += [
    ("chat-history", "/v1/chat/completions", {"messages": CHAT_HISTORY, "max_tokens": 8, "tools": CHAT_TOOLS,
                                              **GREEDY}),
    ("responses-history", "/v1/responses", {"input": RESPONSES_HISTORY, "instructions": "Be brief.",
                                            "max_output_tokens": 8, "tools": RESPONSES_TOOLS, **GREEDY}),
    ("messages-history", "/v1/messages", {"messages": MESSAGES_HISTORY, "system": [{"type": "text", "text": "Be "},
                                                                                  {"type": "text", "text": "brief."}],
                                          "max_tokens": 8, "tools": MESSAGES_TOOLS, **GREEDY}),
]

# Ids, times and joules differ on every run; cached prompt tokens with what the mesh served before (and so
# Anthropic's input_tokens, which leave them out: `_prompt_as_input`).
_MASKS = [
    (re.compile(r'"(id|item_id|call_id|tool_use_id)":"[^"]*"'), r'"\1":"<id>"'),
    (re.compile(r'"(created|created_at)":\d+'), r'"\1":0'),
    (re.compile(r'"energy_j":[0-9.eE+-]+'), '"energy_j":0'),
    (re.compile(r'"(cached_tokens|cache_read_input_tokens)":\d+'), r'"\1":0'),
]


# Anthropic's usage counts a prompt as input_tokens + cache_read_input_tokens: their sum is the prompt
_ANTHROPIC_USAGE = re.compile(r'"input_tokens":(\d+),"output_tokens":(\d+),"cache_read_input_tokens":(\d+)')


def _prompt_as_input(match: re.Match[str]) -> str:
    return f'"input_tokens":{int(match[1]) + int(match[3])},"output_tokens":{match[2]},"cache_read_input_tokens":0'


# vLLM's continuous usage on a chunk of n > 1 choices counts every choice's tokens so far: how far the
# other choices' readers got when the chunk was made, which is a matter of timing
_TOKENS_SO_FAR = re.compile(r'"completion_tokens":\d+,"total_tokens":\d+')


def _chunk_usage_masked(text: str) -> str:
    lines = text.split("\n")
    return "\n".join(_TOKENS_SO_FAR.sub('"completion_tokens":0,"total_tokens":0', line)
                     if line.startswith("data: ") and '"choices":[{' in line else line for line in lines)


def normalized(text: str) -> str:
    text = _chunk_usage_masked(text)
    text = _ANTHROPIC_USAGE.sub(_prompt_as_input, text)
    for pattern, repl in _MASKS:
        text = pattern.sub(repl, text)
    return text


def answers(base_url: str, model: str, cases: list[tuple[str, str, dict[str, Any]]]) -> dict[str, str]:
    """Each case's answer, whole (`<name>`) and streamed (`<name>~stream`, with the usage where the API has
    it), as the bytes came, normalized."""
    out: dict[str, str] = {}
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for name, path, body in cases:
            for streamed in (False, True):
                sent = {**body, "model": model, "stream": streamed}
                if streamed and path in ("/v1/chat/completions", "/v1/completions"):
                    sent["stream_options"] = {"include_usage": True,
                                              "continuous_usage_stats": name.endswith("logprobs")}
                response = client.post(path, json=sent)
                assert response.status_code == 200, (name, response.text)
                out[name + ("~stream" if streamed else "")] = normalized(response.text)
    return out


_CHOICE = re.compile(r'"choices":\[\{"index":(\d+)')


def choices_in_order(text: str) -> str:
    """A stream's events with each choice's together, in choice order (a stable sort: each choice's own events
    keep their order; the events of no choice, usage and [DONE], come last as they came). With n > 1 choices
    the generators take turns as their tokens come, which is a matter of timing, not of the renderer."""
    events = text.split("\n\n")
    return "\n\n".join(sorted(events, key=lambda e: int(m[1]) if (m := _CHOICE.search(e)) else 1 << 30))


# a logprob's last digits are the float32 products' on this machine's CPU (kernels, threads, oneDNN's choice):
# they differ in the 7th significant digit between machines, where the tokens and the rendering do not
_LONG_FLOAT = re.compile(r"-?\d+\.\d{5,}(?:[eE][-+]?\d+)?")
FLOAT_TOLERANCE = 1e-4  # relative


def same_answer(recorded: str, now: str) -> bool:
    """The same bytes, but for long floats (logprobs) within FLOAT_TOLERANCE of each other."""
    if recorded == now:
        return True
    if _LONG_FLOAT.sub("<float>", recorded) != _LONG_FLOAT.sub("<float>", now):
        return False
    pairs = zip(_LONG_FLOAT.findall(recorded), _LONG_FLOAT.findall(now), strict=True)
    return all(abs(float(a) - float(b)) <= FLOAT_TOLERANCE * max(1.0, abs(float(a))) for a, b in pairs)


def first_difference(recorded: str, now: str) -> tuple[str, str]:
    """The first line where an answer differs from its recording: (recorded, now)."""
    for before, after in zip(recorded.splitlines(), now.splitlines(), strict=False):
        if before != after:
            return before, after
    return recorded[-200:], now[-200:]


def replay(path: Path, base_url: str, model: str,
           cases: list[tuple[str, str, dict[str, Any]]]) -> list[tuple[str, str, str]]:
    """Record (AFLEX_RECORD_STREAMS=1) or compare: the answers that differ from the recording, each as (case,
    its first recorded line that differs, the line now)."""
    now = answers(base_url, model, cases)
    if RECORDING:
        path.write_text(json.dumps(now, indent=1, ensure_ascii=False) + "\n")
    recorded: dict[str, str] = json.loads(path.read_text())
    assert sorted(recorded) == sorted(now)
    ordered = {name: (choices_in_order(recorded[name]), choices_in_order(now[name])) for name in recorded}
    return [(name, *first_difference(*pair)) for name, pair in ordered.items() if not same_answer(*pair)]

REASONING_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
_WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
_SUM_ASK = [{"role": "user", "content": "What is 2+2?"}]
# the reasoning model's cases (tests/reasoning_model.py: it reasons, then answers or calls the weather tool)
REASONING_CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("chat-reasoning", "/v1/chat/completions", {"messages": _SUM_ASK, "max_tokens": 60, **GREEDY}),
    ("chat-reasoning-cut", "/v1/chat/completions", {"messages": _SUM_ASK, "max_tokens": 5, **GREEDY}),
    ("chat-reasoning-call", "/v1/chat/completions", {"messages": _WEATHER_ASK, "max_tokens": 60,
                                                     "tools": REASONING_TOOLS, **GREEDY}),
    ("completion-reasoning", "/v1/completions", {"prompt": "What is 2+2?", "max_tokens": 8, **GREEDY}),
    ("responses-reasoning", "/v1/responses", {"input": _SUM_ASK, "max_output_tokens": 60, **GREEDY}),
    ("responses-reasoning-call", "/v1/responses", {"input": _WEATHER_ASK, "max_output_tokens": 60,
                                                   "tools": [{"type": "function", **REASONING_TOOLS[0]["function"]}],
                                                   **GREEDY}),
    ("messages-reasoning", "/v1/messages", {"messages": _SUM_ASK, "max_tokens": 60,
                                            "thinking": {"type": "enabled", "budget_tokens": 40}, **GREEDY}),
    ("messages-reasoning-call", "/v1/messages", {"messages": _WEATHER_ASK, "max_tokens": 60, "tools": [
        {"name": "get_weather", "description": "The weather in a city",
         "input_schema": REASONING_TOOLS[0]["function"]["parameters"]}], **GREEDY}),
]

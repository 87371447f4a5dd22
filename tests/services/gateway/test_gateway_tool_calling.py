"""The conversation with tools as the template sees it: a template that reads `tools` gets them (and earlier
calls with object arguments); one that does not (SmolLM2's) gets the Hermes tool prompt, earlier calls as
`<tool_call>` blocks and results as `<tool_response>` turns."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.gateway.errors import APIError
from services.gateway.openai_schema import ChatCompletionRequest
from services.gateway.tool_calling import template_messages, tool_request
from shared.model.checkpoint import open_model_card
from shared.model.tokenizer import Tokenizer

TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                                "parameters": {"type": "object", "properties": {
                                                    "city": {"type": "string"}}}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY: Any = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
]
# the tool-aware part of a Hermes/Qwen-style template: tools in the system turn, calls and results rendered
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "call {{ c.function.name }} city={{ c.function.arguments.city }}{% endfor %}{% else %}{{ m.content }}{% endif %}"
    "{% if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    tokenizer = open_model_card("default").tokenizer
    assert tokenizer is not None
    return tokenizer


def _render(tokenizer: Tokenizer, body: dict[str, Any]) -> str:
    request = ChatCompletionRequest.model_validate({"messages": HISTORY, **body})
    tools = tool_request(request.conversation(), request.response_format)
    messages, variables = template_messages(request.messages, tools, tokenizer)
    return tokenizer.apply_chat_template(messages, **variables)


def test_a_template_without_tools_gets_the_hermes_tool_prompt(smollm2: Tokenizer) -> None:
    assert not smollm2.template_takes_tools
    text = _render(smollm2, {"tools": TOOLS})
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou are a function calling AI model.")
    assert json.dumps([TOOLS[0]["function"]]) in text  # the functions' JSON, as sent
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           '</tool_call><|im_end|>' in text
    assert '<|im_start|>tool\n<tool_response>\n{"sky": "sunny"}\n</tool_response><|im_end|>' in text
    assert "function calling" not in _render(smollm2, {"tools": TOOLS, "tool_choice": "none"})
    assert "function calling" not in _render(smollm2, {})  # earlier calls render without tools offered


def test_a_template_that_reads_tools_gets_them(smollm2: Tokenizer) -> None:
    own = Tokenizer(smollm2.backend, chat_template=TOOL_TEMPLATE)
    assert own.template_takes_tools
    expected = ("<tools>get_weather;</tools>[system]Be brief.[user]Weather in Paris?"
                '[assistant]call get_weather city=Paris[tool]{"sky": "sunny"} for call_1')
    assert _render(own, {"tools": TOOLS}) == expected


def test_tool_choice_needs_tools() -> None:
    request = ChatCompletionRequest.model_validate({"messages": HISTORY, "tool_choice": "required"})
    with pytest.raises(APIError) as info:
        tool_request(request.conversation(), request.response_format)
    assert (info.value.status, info.value.param) == (400, "tool_choice") and "needs `tools`" in info.value.message

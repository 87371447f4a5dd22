"""Tool calling, for every chat-like API's `Conversation`: the tools and tool choice checked, the conversation
rendered with them, and the grammar that forces a call (the answer's calls are read in services.gateway.parts).

Rendering: a chat template that reads `tools` (Qwen, Llama 3.x, Hermes, ...) gets them, and earlier calls
with their arguments as objects, as transformers passes them. A template that does not (SmolLM2's) gets
AFlex's tool prompt instead: Hermes's system instructions with the functions' JSON, earlier calls as
`<tool_call>` blocks and results as `<tool_response>` turns (as Hermes-2-Pro writes them), so a model is
never offered tools it cannot see. `auto` parses the answer (services.gateway.tool_call_syntax); `required` and a
named function are enforced by an llguidance grammar built from the functions' JSON Schemas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.gateway.conversation_schema import TOOL_NAME, ChatMessage, NamedToolChoice, ResponseFormat
from services.gateway.errors import invalid
from services.gateway.generation_request import Conversation
from services.gateway.tool_call_syntax import Function, ToolCall, call_lark, hermes_block
from shared.model.tokenizer import Tokenizer

TOOL_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
    "what values to plug into functions. Here are the available tools: <tools>{tools}</tools>\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


@dataclass(frozen=True)
class ToolRequest:
    """A request's offered functions and what it asks of them."""

    functions: tuple[Function, ...]
    specs: tuple[dict[str, Any], ...]  # the tools as sent, for the template and the tool prompt
    choice: str  # "none", "auto", "required" or "function" (the one named in `name`)
    name: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """Whether the answer is read for calls (`none` leaves it text)."""
        return self.choice != "none"

    def lark(self, rule: str = "start", marker_ids: tuple[int, int] | None = None) -> str | None:
        """The grammar that forces a call (`required`: any function; a name: that one), as lark text with the
        calls in rule `rule`; None for auto/none."""
        if self.choice == "required":
            return call_lark(self.functions, self.parallel, rule, marker_ids)
        if self.choice == "function":
            return call_lark([f for f in self.functions if f.name == self.name], self.parallel, rule, marker_ids)
        return None


def tool_request(body: Conversation, form: ResponseFormat | None = None) -> ToolRequest | None:
    """The request's tools, checked (a 400 names what is wrong; a forced call may not have a `response_format`
    `form` too); None when it offers none."""
    choice = body.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if not body.tools:
        if named is not None or choice == "required":
            raise invalid("tool_choice needs `tools`: name at least one function to call", "tool_choice")
        return None
    functions = []
    for k, tool in enumerate(body.tools):
        name = tool.function.name
        if not TOOL_NAME.fullmatch(name):
            raise invalid(f"tools[{k}].function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
                          f"tools[{k}].function.name")
        params = tool.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise invalid(f"tools[{k}].function.parameters must be a JSON Schema of an object",
                          f"tools[{k}].function.parameters")
        functions.append(Function(name, params))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise invalid("tools must not name a function twice", "tools")
    if named is not None and named not in names:
        raise invalid(f"tool_choice names {named!r}, which is not one of the tools ({', '.join(names)})",
                      "tool_choice")
    kind = "function" if named is not None else (choice or "auto")
    if kind in ("required", "function") and form is not None and form.type != "text":
        raise invalid("a forced tool call (tool_choice required or a function) cannot also have a "
                      "response_format", "response_format")
    specs = tuple(t.model_dump(exclude_none=True) for t in body.tools)
    return ToolRequest(tuple(functions), specs, str(kind), named, body.parallel_tool_calls)


def _arguments(text: str) -> Any:
    """An earlier call's arguments as an object for a template (as transformers wants them)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def template_messages(messages: list[ChatMessage], tools: ToolRequest | None,
                      tokenizer: Tokenizer) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the messages, the template's extra variables) for `apply_chat_template` (module docstring)."""
    texts = [m.text() for m in messages]
    if tokenizer.template_takes_tools:
        out = []
        for m, text in zip(messages, texts, strict=True):
            item: dict[str, Any] = {"role": m.role, "content": text, **({"name": m.name} if m.name else {})}
            if m.tool_calls:
                item["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
            if m.tool_call_id is not None:
                item["tool_call_id"] = m.tool_call_id
            if m.reasoning_content is not None:
                item["reasoning_content"] = m.reasoning_content
            out.append(item)
        return out, {"tools": list(tools.specs)} if tools is not None else {}
    out = []
    for m, text in zip(messages, texts, strict=True):
        if m.tool_calls:
            blocks = [hermes_block(ToolCall(c.function.name, c.function.arguments)) for c in m.tool_calls]
            text = "\n".join(([text] if text else []) + blocks)
        elif m.role == "tool":
            text = f"<tool_response>\n{text}\n</tool_response>"
        out.append({"role": m.role, "content": text, **({"name": m.name} if m.name else {})})
    if tools is not None and tools.parses:
        prompt = TOOL_PROMPT.format(tools=json.dumps([s["function"] for s in tools.specs], ensure_ascii=False))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}

"""`POST /v1/responses`, stateless: a Responses request served as the chat completion it amounts to, and
the answer in the Responses shape (a `message` item, `function_call` items), whole or as its event stream.

Stateless only (`store: false`, as Codex-style clients send it): AFlex keeps no responses, so `store: true`,
`previous_response_id` and `background` are refused with a 400 that says so, and so are built-in tools
(web search, file search, computer use): only `function` tools can run here. A request that leaves `store`
out is served, statelessly. The stream's events are OpenAI's: `response.created`, `response.in_progress`,
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta`, ...,
`response.function_call_arguments.delta`/`.done`, `response.output_item.done`, `response.completed`, each
with its `sequence_number`.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

import orjson
from pydantic import Field, Strict

from services.gateway.errors import APIError, invalid
from services.gateway.generation import cached_tokens, reasoning_tokens
from services.gateway.openai_schema import (
    Bool,
    ChatCompletionRequest,
    ReasoningEffort,
    _bounds,
    _Model,
    chat_completion_of,
)
from services.gateway.parts import Answer, CallArguments, CallStart, End, Part, Reasoning, Text
from services.gateway.streaming import Identity


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None
    description: str | None = None


class TextConfig(_Model):
    format: TextFormat | None = None


class ReasoningConfig(_Model):
    effort: ReasoningEffort | None = None  # "none": no reasoning (the template's `enable_thinking`)
    summary: str | None = None  # the whole reasoning is given as reasoning text; no summaries are made


class ResponsesRequest(_Model):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: Bool = True
    max_output_tokens: Annotated[int, Strict(), _bounds("max_tokens")] | None = None
    temperature: Annotated[float, Strict(), _bounds("temperature")] | None = None
    top_p: Annotated[float, Strict(), _bounds("top_p")] | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: Bool = False
    store: Bool | None = None
    previous_response_id: str | None = None
    background: Bool | None = None
    seed: Annotated[int, Strict()] | None = None  # not OpenAI's: for reproducible answers, as chat has it
    priority: Annotated[int, Strict(), Field(ge=-(2**31), le=2**31 - 1)] = 0  # vLLM's, as on chat completions
    metadata: dict[str, str] | None = None
    user: str | None = None


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be text or a list of text parts", "input")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise invalid(f"{where}.content[{k}] of type {kind!r} is not supported (text parts only)", "input")
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The input items as chat messages: consecutive function calls become one assistant turn's tool_calls,
    their outputs `tool` turns; a reasoning item is the `reasoning_content` of the assistant turn after it."""
    out: list[dict[str, Any]] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    reasoning: str | None = None  # a reasoning item's text, for the next assistant turn
    for k, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{k}]"
        if kind == "reasoning":
            reasoning = _reasoning_text(item, where)
        elif kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}.role must be user, system, developer or assistant, got {role!r}", "input")
            out.append({"role": role, "content": _text_of(item.get("content"), where)})
            if role == "assistant" and reasoning is not None:
                out[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning is not None:
                    out[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else orjson.dumps(output).decode()})
        else:
            raise invalid(f"{where} of type {kind!r} is not supported (message, reasoning, function_call and "
                          "function_call_output items only)", "input")
    return out


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its reasoning_text parts (else its summary's text)."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise invalid(f"{where}.content must be a list of reasoning_text parts", "input")
    return "".join(p["text"] for p in parts)


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion a Responses request amounts to; a 400 for what a stateless server cannot serve."""
    if body.store:
        raise invalid("store: true is not supported: AFlex serves /v1/responses statelessly and keeps no "
                      "responses; send store: false", "store")
    if body.previous_response_id is not None:
        raise invalid("previous_response_id is not supported: AFlex keeps no responses; send the conversation "
                      "so far in `input`", "previous_response_id")
    if body.background:
        raise invalid("background responses are not supported", "background")
    tools = []
    for k, tool in enumerate(body.tools or []):
        if tool.get("type") != "function":
            raise invalid(f"tools[{k}] of type {tool.get('type')!r} is a built-in tool, which AFlex cannot run; "
                          "only function tools are supported", "tools")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        tools.append({"type": "function", "function": function})
    choice: Any = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise invalid("tool_choice must be none, auto, required or {type: function, name: ...}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    form = body.text.format if body.text is not None else None
    response_format = None
    if form is not None:
        response_format = {"type": form.type} if form.type != "json_schema" else {
            "type": "json_schema", "json_schema": {"name": form.name, "schema": form.schema_, "strict": form.strict}}
    fields = {"model": body.model, "messages": _messages(body), "tools": tools or None, "tool_choice": choice,
              "parallel_tool_calls": body.parallel_tool_calls, "max_completion_tokens": body.max_output_tokens,
              "temperature": body.temperature, "top_p": body.top_p, "response_format": response_format,
              "stream": body.stream, "seed": body.seed, "user": body.user, "priority": body.priority,
              "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None}
    return chat_completion_of(fields, "input", "input must hold at least one message")


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    out = {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached_tokens(usage)},
           "output_tokens": usage["completion_tokens"],
           "output_tokens_details": {"reasoning_tokens": reasoning_tokens(usage)},
           "total_tokens": usage["total_tokens"]}
    if "energy_j" in usage:
        out["energy_j"] = usage["energy_j"]  # AFlex extension, as on chat completions
    return out


class ResponsesRenderer:
    """One Response: its identity and settings, and its output items as they are made (one choice)."""

    def __init__(self, body: ResponsesRequest, identity: Identity) -> None:
        self.body, self.model = body, identity.model
        self.id = "resp_" + identity.id.split("-", 1)[-1]
        self.created_at = identity.created
        self.message_id = f"msg_{uuid.uuid4().hex[:24]}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex[:24]}"
        self._sequence = 0
        self._output: list[dict[str, Any]] = []  # the items so far; an open one as its in_progress self
        self._texts = {"reasoning": "", "message": ""}
        self._open_at: dict[str, int] = {}  # "reasoning"/"message": output index of the open text item
        self._calls: dict[int, tuple[int, dict[str, Any]]] = {}  # call index -> (output index, its item)

    def reasoning(self, text: str, status: str = "completed") -> dict[str, Any]:
        """A reasoning item: the model's whole reasoning as reasoning text (no summary is made)."""
        content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "content": content, "status": status}

    def message(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def function_call(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"), "call_id": call_id,
                "name": name, "arguments": arguments, "status": status}

    def response(self, output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None,
                 finish_reason: str | None = None) -> dict[str, Any]:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": output, "error": None, "incomplete_details": incomplete,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "temperature": 1.0 if b.temperature is None else b.temperature,
                "top_p": 1.0 if b.top_p is None else b.top_p, "parallel_tool_calls": b.parallel_tool_calls,
                "tool_choice": b.tool_choice or "auto", "tools": b.tools or [],
                "text": {"format": (b.text.format.model_dump(by_alias=True, exclude_none=True)
                                    if b.text is not None and b.text.format is not None else {"type": "text"})},
                "store": False, "metadata": b.metadata or {}, "usage": _usage(usage) if usage else None}

    def whole(self, answers: list[Answer]) -> dict[str, Any]:
        answer = answers[0]
        status = "incomplete" if answer.finish_reason == "length" else "completed"
        output = [self.reasoning(answer.reasoning, status)] if answer.reasoning else []
        output += [self.message(answer.content)] if answer.content else []
        output += [self.function_call(c.call_id, c.name, c.arguments) for c in answer.calls]
        return self.response(output, status, answer.usage, answer.finish_reason)

    # -- the event stream: a reasoning item (a reasoning model's), then the message, then each call ---------

    def _event(self, kind: str, **fields: Any) -> bytes:
        self._sequence += 1
        payload = {"type": kind, "sequence_number": self._sequence - 1, **fields}
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def opening(self) -> list[bytes]:
        return [self._event("response.created", response=self.response([], "in_progress", None)),
                self._event("response.in_progress", response=self.response([], "in_progress", None))]

    def part(self, part: Part) -> list[bytes]:
        if isinstance(part, Reasoning):
            return self._add_text("reasoning", part.text)
        if isinstance(part, Text):
            return self._add_text("message", part.text) if part.text and not self._calls else []
        if isinstance(part, CallStart):
            out = self._close_items()
            call = self.function_call(part.call_id, part.name, "", "in_progress")
            self._calls[part.index] = (len(self._output), call)
            self._output.append(call)
            out.append(self._event("response.output_item.added", output_index=len(self._output) - 1,
                                   item=dict(call)))
            return out + self._arguments(part.index, part.arguments)
        if isinstance(part, CallArguments):
            return self._arguments(part.index, part.arguments)
        if isinstance(part, End):
            return self._end(part)
        return []

    def _end(self, end: End) -> list[bytes]:
        out = self._add_text("message", end.text) if end.text and not self._calls else []
        out += self._close_items()
        for at, call in self._calls.values():
            call["status"] = "completed"
            out.append(self._event("response.function_call_arguments.done", item_id=call["id"], output_index=at,
                                   arguments=call["arguments"]))
            out.append(self._event("response.output_item.done", output_index=at, item=call))
        status = "incomplete" if end.finish_reason == "length" else "completed"
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*out, self._event(kind, response=self.response(self._output, status, end.usage, end.finish_reason))]

    def closing(self) -> list[bytes]:
        return []

    def error(self, exc: APIError) -> list[bytes]:
        return [self._event("error", code=exc.code, message=exc.message, param=exc.param)]

    def _arguments(self, index: int, arguments: str) -> list[bytes]:
        at, call = self._calls[index]
        if not arguments:
            return []
        call["arguments"] += arguments
        return [self._event("response.function_call_arguments.delta", item_id=call["id"], output_index=at,
                            delta=arguments)]

    def _where(self, kind: str) -> dict[str, Any]:
        item_id = self.reasoning_id if kind == "reasoning" else self.message_id
        return {"item_id": item_id, "output_index": self._open_at[kind], "content_index": 0}

    @staticmethod
    def _content(kind: str, text: str) -> dict[str, Any]:
        return {"type": "reasoning_text", "text": text} if kind == "reasoning" else \
            {"type": "output_text", "text": text, "annotations": []}

    def _add_text(self, kind: str, delta: str) -> list[bytes]:
        """Open the `kind` item (once: a later one is not streamed), then its piece of text."""
        out: list[bytes] = []
        if kind not in self._open_at:
            if any(item["type"] == kind for item in self._output):
                return []
            out += self._close_items()
            self._open_at[kind] = len(self._output)
            self._output.append(self.reasoning("", "in_progress") if kind == "reasoning" else
                                self.message("", "in_progress"))
            out.append(self._event("response.output_item.added", output_index=self._open_at[kind],
                                   item=self._output[-1]))
            out.append(self._event("response.content_part.added", **self._where(kind),
                                   part=self._content(kind, "")))
        self._texts[kind] += delta
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self._event(f"response.{_TEXT_KINDS[kind]}.delta", **self._where(kind), delta=delta, **extra))
        return out

    def _close_items(self) -> list[bytes]:
        out = []
        for kind in list(self._open_at):
            text = self._texts[kind]
            extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
            out.append(self._event(f"response.{_TEXT_KINDS[kind]}.done", **self._where(kind), text=text, **extra))
            out.append(self._event("response.content_part.done", **self._where(kind),
                                   part=self._content(kind, text)))
            at = self._open_at.pop(kind)
            self._output[at] = self.reasoning(text) if kind == "reasoning" else self.message(text)
            out.append(self._event("response.output_item.done", output_index=at, item=self._output[at]))
        return out


_TEXT_KINDS = {"reasoning": "reasoning_text", "message": "output_text"}

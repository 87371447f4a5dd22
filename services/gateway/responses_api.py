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

import time
import uuid
from collections.abc import AsyncIterator, Iterator
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
from services.gateway.streaming import ChoiceEvents
from services.gateway.tool_call_stream import ToolCallStream, finish_with_calls
from services.gateway.tool_call_syntax import Function


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


class ResponseView:
    """One response's identity and settings, and its output items as they are made."""

    def __init__(self, body: ResponsesRequest, model: str, request_id: str) -> None:
        self.body, self.model = body, model
        self.id = "resp_" + request_id.split("-", 1)[-1]
        self.created_at = int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex[:24]}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex[:24]}"

    def reasoning(self, text: str, status: str = "completed") -> dict[str, Any]:
        """A reasoning item: the model's whole reasoning as reasoning text (no summary is made)."""
        content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "content": content, "status": status}

    def message(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def function_call(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}

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

    def from_chat(self, result: dict[str, Any]) -> dict[str, Any]:
        """A whole chat completion's answer as a Response."""
        choice = result["choices"][0]
        message = choice["message"]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        output = [self.reasoning(message["reasoning_content"], status)] if message.get("reasoning_content") else []
        output += [self.message(message["content"])] if message.get("content") else []
        output += [self.function_call(c) for c in message.get("tool_calls") or []]
        return self.response(output, status, result["usage"], choice["finish_reason"])


def _event(kind: str, n: int, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, "sequence_number": n, **fields}) \
        + b"\n\n"


async def response_events(view: ResponseView, events: ChoiceEvents, first: Any,
                          functions: tuple[Function, ...] | None) -> AsyncIterator[bytes]:
    """The Responses event stream of one answer (one choice), from its `first` event on: a reasoning item
    (a reasoning model's), then the message, then each function call, each output item as it is written."""
    n = 0

    def ev(kind: str, **fields: Any) -> bytes:
        nonlocal n
        n += 1
        return _event(kind, n - 1, **fields)

    yield ev("response.created", response=view.response([], "in_progress", None))
    yield ev("response.in_progress", response=view.response([], "in_progress", None))
    reader = ToolCallStream(functions) if functions is not None else None
    output: list[dict[str, Any]] = []  # the items so far; an open one as its in_progress self
    texts = {"reasoning": "", "message": ""}
    open_at: dict[str, int] = {}  # "reasoning"/"message": output index of the open text item
    calls: dict[int, tuple[int, dict[str, Any]]] = {}  # call index -> (output index, its item)
    kinds = {"reasoning": ("reasoning_text", view.reasoning_id), "message": ("output_text", view.message_id)}

    def part(kind: str, text: str) -> dict[str, Any]:
        return {"type": "reasoning_text", "text": text} if kind == "reasoning" else \
            {"type": "output_text", "text": text, "annotations": []}

    def add_text(kind: str, delta: str) -> Iterator[bytes]:
        """Open the `kind` item (once: a later one is not streamed), then its piece of text."""
        if kind not in open_at:
            if any(item["type"] == kind for item in output):
                return
            yield from close_items()
            open_at[kind] = len(output)
            output.append(view.reasoning("", "in_progress") if kind == "reasoning" else
                          view.message("", "in_progress"))
            yield ev("response.output_item.added", output_index=open_at[kind], item=output[-1])
            yield ev("response.content_part.added", **where(kind), part=part(kind, ""))
        texts[kind] += delta
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        yield ev(f"response.{kinds[kind][0]}.delta", **where(kind), delta=delta, **extra)

    def where(kind: str) -> dict[str, Any]:
        return {"item_id": kinds[kind][1], "output_index": open_at[kind], "content_index": 0}

    def close_items() -> Iterator[bytes]:
        for kind in list(open_at):
            text = texts[kind]
            extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
            yield ev(f"response.{kinds[kind][0]}.done", **where(kind), text=text, **extra)
            yield ev("response.content_part.done", **where(kind), part=part(kind, text))
            at = open_at.pop(kind)
            output[at] = view.reasoning(text) if kind == "reasoning" else view.message(text)
            yield ev("response.output_item.done", output_index=at, item=output[at])

    try:
        item = first
        while item is not None:
            _, event = item
            final = event.finish_reason is not None
            if event.reasoning:
                for chunk in add_text("reasoning", event.reasoning):
                    yield chunk
            # content up to where a call may begin; each call as it is written
            delta, deltas = reader.take(event.text, final) if reader is not None else (event.text, [])
            if delta and not calls:
                for chunk in add_text("message", delta):
                    yield chunk
            for d in deltas:
                if d.name is not None:
                    for chunk in close_items():
                        yield chunk
                    call = view.function_call({"id": f"call_{uuid.uuid4().hex[:24]}",
                                               "function": {"name": d.name, "arguments": ""}}, "in_progress")
                    calls[d.index] = (len(output), call)
                    output.append(call)
                    yield ev("response.output_item.added", output_index=len(output) - 1, item=dict(call))
                at, call = calls[d.index]
                if d.arguments:
                    call["arguments"] += d.arguments
                    yield ev("response.function_call_arguments.delta", item_id=call["id"], output_index=at,
                             delta=d.arguments)
            if final:
                for chunk in close_items():
                    yield chunk
                for at, call in calls.values():
                    call["status"] = "completed"
                    yield ev("response.function_call_arguments.done", item_id=call["id"], output_index=at,
                             arguments=call["arguments"])
                    yield ev("response.output_item.done", output_index=at, item=call)
                finish = finish_with_calls(event.finish_reason, bool(calls))
                status = "incomplete" if finish == "length" else "completed"
                kind = "response.incomplete" if status == "incomplete" else "response.completed"
                yield ev(kind, response=view.response(output, status, event.usage or {}, finish))
            item = await events.next()
    except APIError as exc:  # the status line is sent already: an error event ends the stream
        yield ev("error", code=exc.code, message=exc.message, param=exc.param)
    finally:
        await events.close("client_disconnected")

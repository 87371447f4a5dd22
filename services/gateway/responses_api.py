"""`POST /v1/responses`, stateless: the answer in the Responses shape (a `reasoning` item, a `message` item,
`function_call` items), whole or as its event stream; the request is services.gateway.responses_schema.

The stream's events are OpenAI's: `response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`, ..., `response.function_call_arguments.delta`/
`.done`, `response.output_item.done`, `response.completed` (or `response.incomplete`), each with its
`sequence_number`.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel

from services.gateway.errors import APIError, json_bytes
from services.gateway.generation import cached_tokens, reasoning_tokens
from services.gateway.parts import Answer, CallArguments, CallStart, End, Part, Reasoning, Text
from services.gateway.responses_schema import ResponsesRequest
from services.gateway.streaming import Dialect, Identity


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    out = {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached_tokens(usage)},
           "output_tokens": usage["completion_tokens"],
           "output_tokens_details": {"reasoning_tokens": reasoning_tokens(usage)},
           "total_tokens": usage["total_tokens"]}
    if "energy_j" in usage:
        out["energy_j"] = usage["energy_j"]  # AFlex extension, as on chat completions
    return out


def _sent(value: Any) -> Any:
    """A request's field as the client sent it (the Response echoes the request's settings)."""
    return value.model_dump(exclude_unset=True, by_alias=True) if isinstance(value, BaseModel) else value


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
                "tool_choice": _sent(b.tool_choice) or "auto", "tools": [_sent(t) for t in b.tools or []],
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
        return b"event: " + kind.encode() + b"\ndata: " + json_bytes(payload) + b"\n\n"

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


def responses_dialect(body: ResponsesRequest) -> Dialect:
    """A Response: its settings echo the request's."""
    return Dialect("resp", True, "input", lambda answering: ResponsesRenderer(body, answering.identity))

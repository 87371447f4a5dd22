"""`POST /v1/messages`, Anthropic's Messages API, stateless: the answer in the Messages shape (`thinking`, `text`
and `tool_use` content blocks), whole or as its event stream; the request is services.gateway.messages_schema.

Claude Code and other agents speak it. A reasoning model's reasoning (services.gateway.reasoning) comes as a
`thinking` block before the answer. The stream's events
are Anthropic's: `message_start`, `content_block_start`, `content_block_delta` (`thinking_delta`, `text_delta`,
`input_json_delta`: a tool call's input as it is generated), `content_block_stop`, `message_delta` (with
`stop_reason`: `end_turn`, `max_tokens`, `stop_sequence`, `tool_use`), `message_stop`. Usage is Anthropic's:
`input_tokens` (the prompt tokens not read from the cache), `cache_read_input_tokens` (those the prefix cache
held; the two add up to the prompt), `output_tokens`, and AFlex's `energy_j`. Errors come in Anthropic's
shape (errors.APIError.anthropic_body); `x-api-key` is accepted where `--api-key` is set
(context.check_api_key). `POST /v1/messages/count_tokens` counts a request's input.
"""

from __future__ import annotations

import json
from typing import Any

from services.gateway.errors import APIError, json_bytes
from services.gateway.generation import cached_tokens
from services.gateway.parts import Answer, CallArguments, CallStart, End, Part, Reasoning, Text
from services.gateway.streaming import Dialect, Identity

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def usage_of(usage: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's usage: `input_tokens` are the prompt tokens not read from the cache, so a client that adds
    `input_tokens` and `cache_read_input_tokens` (as Anthropic defines them) counts the prompt once."""
    cached = cached_tokens(usage)
    out = {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
           "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}
    if "energy_j" in usage:
        out["energy_j"] = usage["energy_j"]  # AFlex's, as on chat completions
    return out


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as a tool_use block's `input` (empty where they were cut short by `max_tokens`)."""
    try:
        data = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        data = {}
    return data if isinstance(data, dict) else {}


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish: str | None, stop_sequence: str | None) -> str | None:
    if finish is None:
        return None
    return "stop_sequence" if stop_sequence else STOP_REASONS.get(finish, "end_turn")


def _thinking_block(text: str) -> dict[str, Any]:
    """A reasoning model's reasoning; unsigned (`signature` empty): it is the model's own text, not encrypted."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def _event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + json_bytes({"type": kind, **fields}) + b"\n\n"


class MessagesRenderer:
    """One Messages answer (one choice): its content blocks whole, or as events: a thinking block while
    reasoning comes, a text block while text comes, a tool_use block per call (its input as JSON pieces),
    each closed when the next opens or the answer ends."""

    def __init__(self, identity: Identity, prompt_tokens: int) -> None:
        self.model, self.prompt_tokens = identity.model, prompt_tokens
        self.id = "msg_" + identity.id.split("-", 1)[-1]
        self._count = 0  # blocks opened
        self._open_kind: str | None = None  # "text" or "thinking" while such a block is open

    def message(self, content: list[dict[str, Any]], finish: str | None, stop_sequence: str | None,
                usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason(finish, stop_sequence), "stop_sequence": stop_sequence, "usage": usage}

    def whole(self, answers: list[Answer]) -> dict[str, Any]:
        answer = answers[0]
        content = [_thinking_block(answer.reasoning)] if answer.reasoning else []
        content += [{"type": "text", "text": answer.content}] if answer.content else []
        content += [{"type": "tool_use", "id": _tool_use_id(c.call_id), "name": c.name, "input": _input(c.arguments)}
                    for c in answer.calls]
        return self.message(content, answer.finish_reason, answer.stop_sequence, usage_of(answer.usage))

    def opening(self) -> list[bytes]:
        usage = usage_of({"prompt_tokens": self.prompt_tokens, "completion_tokens": 0})
        return [_event("message_start", message=self.message([], None, None, usage))]

    def part(self, part: Part) -> list[bytes]:
        if isinstance(part, Reasoning):
            return self._text(part.text, "thinking")
        if isinstance(part, Text):
            return self._text(part.text)
        if isinstance(part, CallStart):
            start = {"type": "tool_use", "id": _tool_use_id(part.call_id), "name": part.name, "input": {}}
            out = self._close()
            self._count += 1
            out.append(_event("content_block_start", index=self._count - 1, content_block=start))
            return out + self._arguments(part.arguments)
        if isinstance(part, CallArguments):
            return self._arguments(part.arguments)
        if isinstance(part, End):
            usage = usage_of(part.usage or {"prompt_tokens": self.prompt_tokens, "completion_tokens": 0})
            delta = {"stop_reason": stop_reason(part.finish_reason, part.stop_sequence),
                     "stop_sequence": part.stop_sequence}
            return [*self._text(part.text), *self._close(), _event("message_delta", delta=delta, usage=usage),
                    _event("message_stop")]
        return []

    def closing(self) -> list[bytes]:
        return []

    def error(self, exc: APIError) -> list[bytes]:
        return [_event("error", error=exc.anthropic_body()["error"])]

    def _text(self, text: str, kind: str = "text") -> list[bytes]:
        if not text:
            return []
        out = []
        if self._open_kind != kind:
            out += self._close()
            self._open_kind, self._count = kind, self._count + 1
            start = _thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
            out.append(_event("content_block_start", index=self._count - 1, content_block=start))
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
            {"type": "text_delta", "text": text}
        return [*out, _event("content_block_delta", index=self._count - 1, delta=delta)]

    def _arguments(self, arguments: str) -> list[bytes]:
        if not arguments:
            return []
        return [_event("content_block_delta", index=self._count - 1,
                       delta={"type": "input_json_delta", "partial_json": arguments})]

    def _close(self) -> list[bytes]:
        """The open block's end (none before the first)."""
        self._open_kind = None
        return [_event("content_block_stop", index=self._count - 1)] if self._count else []


# An Anthropic message: its usage at the start counts the prompt
MESSAGES_DIALECT = Dialect("msg", True, "messages",
                           lambda answering: MessagesRenderer(answering.identity, len(answering.prompt_ids)))

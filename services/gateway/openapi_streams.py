"""What /openapi.json says a streamed answer is, per API: its server-sent events and each event's data.

Chat completions and completions send `data:` lines only, each a chunk's JSON (or an error body), then
`data: [DONE]`; Responses and Messages name each event (`event:`) and its data is that event's JSON
(services.gateway.openai_render, responses_api, messages_api).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

RESPONSE_EVENTS = ("response.created", "response.in_progress", "response.output_item.added",
                   "response.content_part.added", "response.reasoning_text.delta", "response.reasoning_text.done",
                   "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                   "response.function_call_arguments.delta", "response.function_call_arguments.done",
                   "response.output_item.done", "response.completed", "response.incomplete", "error")
MESSAGE_EVENTS = ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
                  "message_delta", "message_stop", "error")


class _Event(BaseModel):
    model_config = ConfigDict(extra="allow")  # each kind of event has fields of its own


class ChunkChoice(_Event):
    index: int
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletionChunk(_Event):
    """One `data:` of a streamed chat completion (`choices: []` on the last, which carries the usage)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]


class CompletionChunk(_Event):
    """One `data:` of a streamed completion."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[ChunkChoice]


class ResponseStreamEvent(_Event):
    type: str  # the event's name again (RESPONSE_EVENTS)
    sequence_number: int


class AnthropicStreamEvent(_Event):
    type: str  # the event's name again (MESSAGE_EVENTS)


# path -> (the model of each event's data, the events' names; None: unnamed `data:` lines ending in [DONE])
STREAMS: dict[str, tuple[type[BaseModel], tuple[str, ...] | None]] = {
    "/v1/chat/completions": (ChatCompletionChunk, None),
    "/v1/completions": (CompletionChunk, None),
    "/v1/responses": (ResponseStreamEvent, RESPONSE_EVENTS),
    "/v1/messages": (AnthropicStreamEvent, MESSAGE_EVENTS),
}


def stream_schema(path: str, ref: dict[str, str], error: dict[str, str]) -> dict[str, Any]:
    """One server-sent event of `path`'s stream: its data's JSON as `ref`, or an `error` body (OpenAI's streams:
    also the closing `[DONE]`)."""
    model, names = STREAMS[path]
    if names is None:
        data: dict[str, Any] = {"anyOf": [{"type": "string", "const": "[DONE]"}, {
            "type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [ref, error]}}],
            "description": f"a {model.__name__} as JSON, an error body, or `[DONE]` (the last)"}
        return {"type": "object", "required": ["data"], "properties": {"data": data}}
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": ref,
            "description": f"the event's {model.__name__} as JSON"}
    return {"type": "object", "required": ["event", "data"],
            "properties": {"event": {"type": "string", "enum": list(names)}, "data": data}}

"""The one request the answer path serves, whatever API it came in: each API maps its own request to these.

`GenerationRequest` is what answering.generate needs (sampling, budget, choices, stream); `Conversation` is
what a chat-like API's prompt is made of (turns, tools, template variables), rendered by tool_calling.
Chat completions, completions, Responses and Messages each build them from their own models, field by
field: no API's request is read back through another API's shape.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shared.messages import SamplingSpec

if TYPE_CHECKING:
    from services.gateway.conversation_schema import ChatMessage, NamedToolChoice, ResponseFormat, ToolSpec


@dataclass(frozen=True)
class GenerationRequest:
    """A request's sampling, budget and choices. `sampling.max_tokens` is set once the prompt is known."""

    model: str | None
    sampling: SamplingSpec
    max_tokens: int | None  # as asked; None: the API's default (answering)
    stop: tuple[str, ...] = ()
    n: int = 1
    stream: bool = False
    priority: int = 0  # vLLM's: lower is served first
    response_format: ResponseFormat | None = None

    def sampled(self, max_tokens: int) -> SamplingSpec:
        return dataclasses.replace(self.sampling, max_tokens=max_tokens)


@dataclass(frozen=True)
class Conversation:
    """A chat-like request's prompt: its turns, its offered tools and the template's extra variables."""

    messages: list[ChatMessage]
    tools: list[ToolSpec] | None = None
    tool_choice: str | NamedToolChoice | None = None  # "none", "auto", "required", or one named function
    parallel_tool_calls: bool = True
    template_variables: dict[str, Any] = field(default_factory=dict)

"""The requests of Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), typed as far
as the server serves them, and what they ask.

Content is text or typed blocks: `text`, `thinking` and `redacted_thinking` and `tool_use` in assistant turns,
`text` and `tool_result` in user turns; tools are client tools (`input_schema`); an image, a document or a
server tool is outside the schema and refused by name. A request maps to the answer path's
`GenerationRequest` and `Conversation` field by field: an assistant turn's `tool_use` blocks are its calls,
a user turn's `tool_result` blocks `tool` turns (before the user's own text, as they answer the calls before
it), earlier `thinking` blocks the turn's reasoning (a template may render it); `thinking` sets the
template's `enable_thinking` (`budget_tokens` is taken as given: `max_tokens` bounds reasoning and answer).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, Strict, field_validator, model_validator

from services.gateway.api_model import WHOLE, APIModel, Bool, NonEmpty, Seed, bounds, refuse_kinds, text_of, when
from services.gateway.conversation_schema import (
    ChatMessage,
    FunctionCallSpec,
    FunctionName,
    FunctionSpec,
    NamedFunction,
    NamedToolChoice,
    ObjectSchema,
    ToolCallSpec,
    ToolSpec,
)
from services.gateway.errors import invalid
from services.gateway.generation_request import Conversation, GenerationRequest
from shared.messages import SamplingSpec


class TextBlock(APIModel):
    type: Literal["text"]
    text: str


class ThinkingBlock(APIModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(APIModel):
    """Another server's encrypted reasoning: nothing here can read it, so it is left out."""

    type: Literal["redacted_thinking"]
    data: str | None = None


class ToolUseBlock(APIModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(APIModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: Bool | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return refuse_kinds(value, ("text",), "tool_result content blocks", "text blocks only")


USER_BLOCKS = ("text", "tool_result")
ASSISTANT_BLOCKS = ("text", "thinking", "redacted_thinking", "tool_use")


class UserMessage(APIModel):
    role: Literal["user"]
    content: str | list[Annotated[TextBlock | ToolResultBlock, Field(discriminator="type")]]

    @field_validator("content", mode="before")
    @classmethod
    def _served_blocks(cls, value: Any) -> Any:
        return refuse_kinds(value, USER_BLOCKS, "content blocks", "text and tool_result blocks in user turns")


class AssistantMessage(APIModel):
    role: Literal["assistant"]
    content: str | list[Annotated[TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock,
                                  Field(discriminator="type")]]

    @field_validator("content", mode="before")
    @classmethod
    def _served_blocks(cls, value: Any) -> Any:
        return refuse_kinds(value, ASSISTANT_BLOCKS, "content blocks",
                            "text, thinking and tool_use blocks in assistant turns")


InputMessage = Annotated[UserMessage | AssistantMessage, Field(discriminator="role")]
# at least one message that is a turn: text, or a text, tool_use or tool_result block (thinking alone is none)
_A_TURN = {"contains": {"anyOf": [{"properties": {"content": {"type": "string"}}}, {"properties": {"content": {
    "type": "array", "contains": {"properties": {"type": {"enum": ["text", "tool_use", "tool_result"]}}}}}}]}}


class ClientTool(APIModel):
    type: Literal["custom"] | None = None
    name: FunctionName
    description: str | None = None
    input_schema: ObjectSchema | None = None


class ToolChoice(APIModel):
    model_config = ConfigDict(json_schema_extra=when("type", {"const": "tool"}, {
        "required": ["name"], "properties": {"name": {"type": "string"}}}))

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type tool: the tool to call
    disable_parallel_tool_use: Bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and self.name is None:
            raise ValueError("tool_choice of type tool needs the tool's name")
        return self


class Thinking(APIModel):
    model_config = ConfigDict(json_schema_extra=when("type", {"const": "enabled"}, {
        "required": ["budget_tokens"], "properties": {"budget_tokens": {"type": "integer", "minimum": 1}}}))

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: Any = None  # taken as given: `max_tokens` bounds reasoning and answer

    @model_validator(mode="after")
    def _budget(self) -> Thinking:
        budget = self.budget_tokens  # an integer as JSON has it (2.0 is one), as every int field takes it
        whole = (isinstance(budget, int) and not isinstance(budget, bool)) or (
            isinstance(budget, float) and budget.is_integer())
        if self.type == "enabled" and not (whole and budget >= 1):
            raise ValueError("thinking of type enabled needs budget_tokens, a positive integer")
        return self


_CHOICES: dict[str, str] = {"auto": "auto", "any": "required", "none": "none"}


class CountTokensRequest(APIModel):
    """The prompt of a Messages request: what count_tokens counts."""

    model: str | None = None
    messages: Annotated[list[InputMessage], Field(min_length=1, json_schema_extra=_A_TURN)]
    system: str | list[TextBlock] | None = None
    tools: list[ClientTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _text_system(cls, value: Any) -> Any:
        return refuse_kinds(value, ("text",), "system", "text blocks only")

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools_only(cls, value: Any) -> Any:
        return refuse_kinds(value, ("custom",), "tools", "server tools cannot run here: only client tools with a "
                                                         "name and an input_schema")

    def conversation(self) -> Conversation:
        tools = [ToolSpec(type="function", function=FunctionSpec(
            name=t.name, parameters=t.input_schema or {"type": "object"}, description=t.description))
            for t in self.tools or []]
        choice = self.tool_choice or ToolChoice(type="auto")
        picked: str | NamedToolChoice = _CHOICES.get(choice.type) or NamedToolChoice(
            type="function", function=NamedFunction(name=choice.name or ""))
        variables = {} if self.thinking is None else {"enable_thinking": self.thinking.type != "disabled"}
        return Conversation(self._turns(), tools or None, picked if tools else None,
                            not choice.disable_parallel_tool_use, variables)

    def _turns(self) -> list[ChatMessage]:
        """The conversation as chat turns (module docstring)."""
        out = [ChatMessage(role="system", content=text_of(self.system))] if self.system else []
        for message in self.messages:
            if isinstance(message.content, str):
                out.append(ChatMessage(role=message.role, content=message.content))
                continue
            texts, calls, results, thoughts = [], [], [], []
            for block in message.content:
                if isinstance(block, TextBlock):
                    texts.append(block.text)
                elif isinstance(block, ThinkingBlock):
                    thoughts.append(block.thinking)
                elif isinstance(block, ToolUseBlock):
                    calls.append(ToolCallSpec(id=block.id, function=FunctionCallSpec(
                        name=block.name, arguments=json.dumps(block.input))))
                elif isinstance(block, ToolResultBlock):
                    results.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id,
                                               content=text_of(block.content)))
            out += results
            if texts or calls:
                out.append(ChatMessage(role=message.role, content="".join(texts) or None, tool_calls=calls or None,
                                       reasoning_content="".join(thoughts) if thoughts else None))
        if not any(m.role != "system" for m in out):  # thinking alone is no turn
            raise invalid("messages must hold at least one turn of text, tool_use or tool_result", "messages")
        return out


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Strict(), bounds("max_tokens"), WHOLE]
    stop_sequences: list[NonEmpty] | None = None
    temperature: Annotated[float, Strict(), Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Strict(), bounds("top_p")] | None = None
    top_k: Annotated[int, Strict(), bounds("top_k"), WHOLE] | None = None
    stream: Bool = False
    metadata: dict[str, Any] | None = None
    seed: Seed | None = None  # not Anthropic's: reproducible answers, as chat has it

    def generation(self) -> GenerationRequest:
        sampling = SamplingSpec(temperature=1.0 if self.temperature is None else self.temperature,
                                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed)
        return GenerationRequest(self.model, sampling, self.max_tokens, tuple(self.stop_sequences or ()),
                                 stream=self.stream)

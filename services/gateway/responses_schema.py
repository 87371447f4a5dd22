"""The request of `POST /v1/responses` (stateless), typed as far as the server serves it, and what it asks.

Input items are messages (text parts), reasoning, function calls and their outputs; tools are function tools.
What a stateless server cannot serve is outside the schema and refused by name: `store: true`,
`previous_response_id`, `background`, built-in tools, image or file parts. The request maps to the answer
path's `GenerationRequest` and `Conversation` field by field: consecutive function calls become one
assistant turn's calls, their outputs `tool` turns, a reasoning item the next assistant turn's reasoning.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Strict, Tag, ValidationInfo, WithJsonSchema, field_validator

from services.gateway.api_model import (
    FORCED_CALL,
    NEEDS_TOOLS,
    WHOLE,
    APIModel,
    Bool,
    Priority,
    Seed,
    bounds,
    refuse_kinds,
    text_of,
    when,
)
from services.gateway.conversation_schema import (
    ChatMessage,
    FunctionCallSpec,
    FunctionName,
    FunctionSpec,
    JsonSchemaSpec,
    NamedFunction,
    NamedToolChoice,
    ObjectSchema,
    ReasoningEffort,
    ResponseFormat,
    ToolCallSpec,
    ToolSpec,
    effort_variables,
)
from services.gateway.errors import invalid, json_bytes
from services.gateway.generation_request import Conversation, GenerationRequest
from shared.messages import SamplingSpec

TEXT_PARTS = ("input_text", "output_text", "text")
STATELESS = {
    "store": "store: true is not supported: AFlex serves /v1/responses statelessly and keeps no responses; send "
             "store: false",
    "previous_response_id": "previous_response_id is not supported: AFlex keeps no responses; send the "
                            "conversation so far in `input`",
    "background": "background responses are not supported"}
Off = Annotated[bool, Strict(), WithJsonSchema({"type": "boolean", "const": False})]  # true is refused by name


class TextFormat(APIModel):
    model_config = ConfigDict(json_schema_extra=when("type", {"const": "json_schema"}, {
        "required": ["schema"], "properties": {"schema": {"type": "object"}}}))

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None
    description: str | None = None


class TextConfig(APIModel):
    format: TextFormat | None = None


class ReasoningConfig(APIModel):
    effort: ReasoningEffort | None = None  # "none": no reasoning (the template's `enable_thinking`)
    summary: str | None = None  # the whole reasoning is given as reasoning text; no summaries are made


class InputText(APIModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(APIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        return refuse_kinds(value, TEXT_PARTS, "content parts")


class ReasoningText(APIModel):
    type: str = "reasoning_text"  # reasoning_text, summary_text: the text is what counts
    text: str


class ReasoningItem(APIModel):
    """A reasoning item: its reasoning_text parts (else its summary's text)."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[ReasoningText] | None = None

    def text(self) -> str:
        return text_of(self.content or self.summary or [])


class FunctionCallItem(APIModel):
    type: Literal["function_call"]
    call_id: str | None = None
    name: str
    arguments: str


class FunctionCallOutputItem(APIModel):
    type: Literal["function_call_output"]
    call_id: str | None = None
    output: Any = None  # text, or any JSON (sent to the model as its JSON text)


def _item_kind(item: Any) -> str:
    return str(item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", ""))


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[ReasoningItem, Tag("reasoning")]
                      | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")], Discriminator(_item_kind)]
# at least one item that is a turn (reasoning alone is no conversation)
_A_TURN = {"contains": {"properties": {"type": {"enum": ["message", "function_call", "function_call_output"]}}}}


class FunctionTool(APIModel):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: ObjectSchema | None = None
    strict: Bool | None = None


class NamedFunctionChoice(APIModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(APIModel):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        when("tool_choice", FORCED_CALL, NEEDS_TOOLS),
        when("tool_choice", FORCED_CALL, {"properties": {"text": {"anyOf": [{"type": "null"}, {"properties": {
            "format": {"anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]}}}]}}}),
    ]})

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1, json_schema_extra=_A_TURN)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: Bool = True
    max_output_tokens: Annotated[int, Strict(), bounds("max_tokens"), WHOLE] | None = None
    temperature: Annotated[float, Strict(), bounds("temperature")] | None = None
    top_p: Annotated[float, Strict(), bounds("top_p")] | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: Bool = False
    store: Off | None = None  # stateless: AFlex keeps no responses
    previous_response_id: None = None
    background: Off | None = None
    seed: Seed | None = None  # not OpenAI's: for reproducible answers, as chat has it
    priority: Priority = 0  # vLLM's, as on chat completions
    metadata: dict[str, str] | None = None
    user: str | None = None

    @field_validator("store", "previous_response_id", "background", mode="before")
    @classmethod
    def _stateless(cls, value: Any, info: ValidationInfo) -> Any:
        """What a stateless server cannot do, refused by name (a stored or background response, a previous one)."""
        if value is True or (info.field_name == "previous_response_id" and value is not None):
            raise ValueError(STATELESS[str(info.field_name)])
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        return refuse_kinds(value, ("function",), "tools", "a built-in tool, which AFlex cannot run; only function "
                                                            "tools are supported")

    def response_format(self) -> ResponseFormat | None:
        form = self.text.format if self.text is not None else None
        if form is None:
            return None
        if form.type != "json_schema":
            return ResponseFormat(type=form.type)
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaSpec.model_validate(
            {"name": form.name, "schema": form.schema_, "strict": form.strict}))

    def generation(self) -> GenerationRequest:
        sampling = SamplingSpec(temperature=1.0 if self.temperature is None else self.temperature,
                                top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed)
        return GenerationRequest(self.model, sampling, self.max_output_tokens, stream=self.stream,
                                 priority=self.priority, response_format=self.response_format())

    def conversation(self) -> Conversation:
        tools = [ToolSpec(type="function", function=FunctionSpec(
            name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
            for t in self.tools or []]
        choice: str | NamedToolChoice | None = None
        if isinstance(self.tool_choice, NamedFunctionChoice):
            choice = NamedToolChoice(type="function", function=NamedFunction(name=self.tool_choice.name))
        else:
            choice = self.tool_choice
        effort = self.reasoning.effort if self.reasoning is not None else None
        return Conversation(self._messages(), tools or None, choice, self.parallel_tool_calls,
                            effort_variables(effort))

    def _messages(self) -> list[ChatMessage]:
        """The input items as chat turns (module docstring); a 400 when there is no turn."""
        out = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        items: list[Any] = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) \
            else self.input
        reasoning: str | None = None  # a reasoning item's text, for the next assistant turn
        for item in items:
            if isinstance(item, ReasoningItem):
                reasoning = item.text()
            elif isinstance(item, MessageItem):
                out.append(ChatMessage(role=item.role, content=text_of(item.content)))
                if item.role == "assistant" and reasoning is not None:
                    out[-1].reasoning_content, reasoning = reasoning, None
            elif isinstance(item, FunctionCallItem):
                call = ToolCallSpec(id=item.call_id, function=FunctionCallSpec(name=item.name,
                                                                              arguments=item.arguments))
                last = out[-1] if out else None
                if last is not None and last.role == "assistant" and last.tool_calls:
                    last.tool_calls.append(call)
                else:
                    out.append(ChatMessage(role="assistant", content=None, tool_calls=[call],
                                           reasoning_content=reasoning))
                    reasoning = None
            else:
                output = item.output
                out.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                       content=output if isinstance(output, str) else json_bytes(output).decode()))
        if not any(not isinstance(item, ReasoningItem) for item in items):
            raise invalid("input must hold at least one message", "input")
        return out

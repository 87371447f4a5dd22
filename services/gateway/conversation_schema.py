"""What every chat-like API's conversation is made of, as pydantic models: turns, their text parts and earlier
calls, the offered functions, the tool choice and the structured output asked for.

Chat completions take them as they are; Responses and Messages build them from their own items and blocks
(responses_schema, messages_schema), and the answer path's `Conversation` holds them (generation_request).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema, field_validator

from services.gateway.api_model import APIModel, Bool, refuse_kinds, text_of, when

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
# A function's name and its arguments' JSON Schema (an object's) as the schema states them; tool_calling checks
# both with a 400 that names the tool (`tools[k].function.name`)
FunctionName = Annotated[str, WithJsonSchema({"type": "string", "pattern": f"^{TOOL_NAME.pattern}$"})]
ObjectSchema = Annotated[dict[str, Any], WithJsonSchema(
    {"type": "object", "properties": {"type": {"const": "object"}}, "additionalProperties": True})]


class TextPart(APIModel):
    type: Literal["text"]
    text: str


class FunctionCallSpec(APIModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCallSpec(APIModel):
    """An earlier assistant turn's call, sent back with the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallSpec


class ChatMessage(APIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallSpec] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this result answers
    reasoning_content: str | None = None  # assistant turns: their reasoning, sent back (a template may render it)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        return refuse_kinds(value, ("text",), "content parts")

    def text(self) -> str:
        return text_of(self.content)


class FunctionSpec(APIModel):
    name: FunctionName
    description: str | None = None
    parameters: ObjectSchema | None = None  # a JSON Schema of the arguments
    strict: Bool | None = None


class ToolSpec(APIModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(APIModel):
    name: str


class NamedToolChoice(APIModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(APIModel):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None
    description: str | None = None


class ResponseFormat(APIModel):
    """OpenAI's structured outputs: the output is constrained to JSON (any object, or one schema)."""

    model_config = ConfigDict(json_schema_extra=when("type", {"const": "json_schema"}, {
        "required": ["json_schema"], "properties": {"json_schema": {
            "type": "object", "required": ["schema"], "properties": {"schema": {"type": "object"}}}}}))

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


def effort_variables(effort: str | None) -> dict[str, Any]:
    """A reasoning effort as the template's variables: "none" turns thinking off (`enable_thinking`), the others
    turn it on and pass the effort on (templates that grade it read `reasoning_effort`)."""
    if effort is None:
        return {}
    return {"enable_thinking": False} if effort == "none" else {"enable_thinking": True, "reasoning_effort": effort}

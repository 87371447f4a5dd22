"""What every API's request models share: strict scalars, the sampling bounds, and text from text parts.

Numbers and booleans are strict (`"temperature": "hot"` or `"stream": "yes"` is a 400). An int where a float
is expected is fine, and so is a float with an integer's value where an int is, as in JSON Schema. Unknown
extra fields are ignored. A model's JSON Schema is what /openapi.json says, so it states what the server
accepts: a kind of content the server refuses is not in the schema, and a before-validator refuses it by
name (`refuse_kinds`), so the 400 says what was wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Protocol

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict

from shared.model.params import VALUE_RANGES


def _whole(value: Any) -> Any:
    """An integer as JSON has it: `2.0` is one (JSON Schema's `integer` holds it), `true` and `"2"` are not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


WHOLE = BeforeValidator(_whole)  # the last of an int's annotations: its bounds before it stay JSON Schema's
Bool = Annotated[bool, Strict()]
TokenId = Annotated[int, Strict(), Field(ge=0, le=2**31 - 1), WHOLE]  # no vocabulary is larger
Seed = Annotated[int, Strict(), Field(ge=-(2**63), le=2**63 - 1), WHOLE]  # a 64-bit seed, as vLLM's
Priority = Annotated[int, Strict(), Field(ge=-(2**31), le=2**31 - 1), WHOLE]  # vLLM's: lower is served first
NonEmpty = Annotated[str, Field(min_length=1)]


class APIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


def bounds(name: str) -> Any:
    """The pydantic bounds of a sampling value: its range as `shared.model.params.VALUE_RANGES` declares it."""
    allowed = VALUE_RANGES[name]
    if allowed.low_open:
        return Field(gt=allowed.low, le=allowed.high)
    return Field(ge=allowed.low, le=allowed.high)


class HasText(Protocol):
    @property
    def text(self) -> str: ...


def text_of(content: str | Sequence[HasText] | None) -> str:
    """Text, or text parts joined (every API's content: a string or a list of text parts)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)


def refuse_kinds(value: Any, kinds: Sequence[str], what: str, why: str = "text only") -> Any:
    """A before-validator's check of a list of typed objects (content parts, tools): one whose `type` is not
    in `kinds` is refused by name (an image, a built-in tool), before the schema's own error would say less."""
    if isinstance(value, list):
        for k, item in enumerate(value):
            kind = item.get("type") if isinstance(item, dict) else None
            if isinstance(kind, str) and kind not in kinds:
                raise ValueError(f"{what}[{k}] of type {kind!r} is not supported ({why})")
    return value


# Rules between fields, as JSON Schema states them (`if`/`then`), for the models' `json_schema_extra`
def when(field: str, present: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema's `if field is present and matches present, then ...`."""
    return {"if": {"required": [field], "properties": {field: present}}, "then": then}


def needs(field: str, value: Any) -> dict[str, Any]:
    return {"required": [field], "properties": {field: {"const": value}}}


FORCED_CALL = {"anyOf": [{"const": "required"}, {"type": "object"}]}  # a tool_choice that forces a call
NEEDS_TOOLS = {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}

"""Request bodies of the OpenAI endpoints, as pydantic models (unknown extra fields are ignored).

Numbers and booleans are strict (`"temperature": "hot"` or `"stream": "yes"` is a 400, an int where a
float is expected is fine). Ranges follow OpenAI and vLLM; `SamplingSpec` is built from the validated
fields. vLLM's extensions `top_k`, `min_tokens`, `ignore_eos`, `stop_token_ids` and `repetition_penalty`
are honoured (the trace replayer needs the first four to force output lengths).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator

from services.gateway.errors import invalid
from shared.messages import SamplingSpec
from shared.model.params import VALUE_RANGES

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]
TokenId = Annotated[int, Strict(), Field(ge=0)]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _bounds(name: str) -> Any:
    """The pydantic bounds of a sampling value: its range as `shared.model.params.VALUE_RANGES` declares it."""
    allowed = VALUE_RANGES[name]
    if allowed.low_open:
        return Field(gt=allowed.low, le=allowed.high)
    return Field(ge=allowed.low, le=allowed.high)
MAX_N = 16  # choices per request
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Model):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False  # vLLM's: the usage so far on every chunk (with include_usage)


class ContentPart(_Model):
    type: str
    text: str | None = None


class FunctionCallSpec(_Model):
    name: str
    arguments: str  # a JSON object's text


class ToolCallSpec(_Model):
    """An earlier assistant turn's call, sent back with the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallSpec


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallSpec] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this result answers
    reasoning_content: str | None = None  # assistant turns: their reasoning, sent back (a template may render it)

    def text(self) -> str:
        """The content as one string; content-part arrays may only hold text parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content parts of type {part.type!r} are not supported (text only)")
            texts.append(part.text)
        return "".join(texts)


class FunctionSpec(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments
    strict: Bool | None = None


class ToolSpec(_Model):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(_Model):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None
    description: str | None = None


class ResponseFormat(_Model):
    """OpenAI's structured outputs: the output is constrained to JSON (any object, or one schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class GenerationRequest(_Model):
    """Fields common to chat completions and completions."""

    model: str | None = None
    max_tokens: Annotated[int, Strict(), _bounds("max_tokens")] | None = None
    temperature: Annotated[float, Strict(), _bounds("temperature")] | None = None
    top_p: Annotated[float, Strict(), _bounds("top_p")] | None = None
    n: Annotated[int, Strict(), Field(ge=1, le=MAX_N)] = 1  # choices; they share the prompt's prefill
    stream: Bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Strict(), Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    presence_penalty: Annotated[float, Strict(), _bounds("presence_penalty")] | None = None
    frequency_penalty: Annotated[float, Strict(), _bounds("frequency_penalty")] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions
    repetition_penalty: Annotated[float, Strict(), _bounds("repetition_penalty")] | None = None
    return_tokens_as_token_ids: Bool = False  # logprobs name tokens "token_id:<id>", as vLLM can
    top_k: Annotated[int, Strict(), _bounds("top_k")] | None = None
    min_tokens: Annotated[int, Strict(), _bounds("min_tokens")] = 0
    ignore_eos: Bool = False
    stop_token_ids: list[TokenId] | None = None
    priority: Annotated[int, Strict(), Field(ge=-(2**31), le=2**31 - 1)] = 0  # lower is served first

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(top alternatives per sampled token, per prompt token); None: not asked."""
        return None, None

    def sampling(self, max_tokens: int) -> SamplingSpec:
        logprobs, prompt_logprobs = self.logprob_counts()
        return SamplingSpec(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


LogprobCount = Annotated[int, Strict(), _bounds("logprobs")]


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Annotated[int, Strict(), _bounds("max_tokens")] | None = None
    logprobs: Bool | None = None
    top_logprobs: LogprobCount | None = None  # needs `logprobs: true` (the route says so)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = True
    # reasoning models: "none" turns thinking off through the template's `enable_thinking`; the others turn
    # it on and reach the template as `reasoning_effort` (templates that grade effort read it)
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the chat template

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(value or ()) & {"messages", "tools", "add_generation_prompt", "add_special_tokens"})
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields do")
        return value

    def template_variables(self) -> dict[str, Any]:
        """The chat template's extra variables this request sets (`reasoning_effort`, `chat_template_kwargs`)."""
        variables: dict[str, Any] = {}
        if self.reasoning_effort is not None:
            variables["enable_thinking"] = self.reasoning_effort != "none"
            if self.reasoning_effort != "none":
                variables["reasoning_effort"] = self.reasoning_effort
        return variables | (self.chat_template_kwargs or {})

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` wins over the deprecated `max_tokens`, as in vLLM."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(GenerationRequest):
    prompt: Prompt
    echo: Bool = False  # the prompt comes back before the completion (with `logprobs`, its logprobs too)
    logprobs: LogprobCount | None = None

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None


def chat_completion_of(fields: dict[str, Any], param: str, empty: str) -> ChatCompletionRequest:
    """The chat completion another API's request amounts to (Responses, Messages): its `fields`, those that are
    None left out; a 400 naming `param` when there are no messages (`empty` says so) or a field is invalid."""
    if not fields["messages"]:
        raise invalid(empty, param)
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValueError as exc:
        raise invalid(f"{param}: {exc}", param) from None

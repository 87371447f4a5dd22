"""Request bodies of OpenAI's chat completions and completions, as pydantic models (services.gateway.api_model).

Ranges follow OpenAI and vLLM; each request maps itself to the answer path's `GenerationRequest` (and a chat
to its `Conversation`). vLLM's extensions `top_k`, `min_tokens`, `ignore_eos`, `stop_token_ids` and
`repetition_penalty` are honoured (the trace replayer needs the first four to force output lengths). Rules
between fields (`top_logprobs` needs `logprobs`, a forced call needs `tools`, ...) are in the JSON Schema
too (`if`/`then`), so a request built from /openapi.json alone meets them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, Strict, field_validator

from services.gateway.api_model import (
    FORCED_CALL,
    NEEDS_TOOLS,
    WHOLE,
    APIModel,
    Bool,
    NonEmpty,
    Priority,
    Seed,
    TokenId,
    bounds,
    needs,
    when,
)
from services.gateway.conversation_schema import (
    ChatMessage,
    NamedToolChoice,
    ReasoningEffort,
    ResponseFormat,
    ToolSpec,
    effort_variables,
)
from services.gateway.generation_request import Conversation, GenerationRequest
from shared.messages import SamplingSpec

MAX_N = 16  # choices per request
RESERVED_VARIABLES = {"messages", "tools", "add_generation_prompt", "add_special_tokens"}  # the request's own
class StreamOptions(APIModel):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False  # vLLM's: the usage so far on every chunk (with include_usage)


STREAM_OPTIONS_NEED_STREAM = when("stream_options", {"type": "object"}, needs("stream", True))


class OpenAIRequest(APIModel):
    """Fields common to chat completions and completions."""

    model: str | None = None
    max_tokens: Annotated[int, Strict(), bounds("max_tokens"), WHOLE] | None = None
    temperature: Annotated[float, Strict(), bounds("temperature")] | None = None
    top_p: Annotated[float, Strict(), bounds("top_p")] | None = None
    n: Annotated[int, Strict(), Field(ge=1, le=MAX_N), WHOLE] = 1  # choices; they share the prompt's prefill
    stream: Bool = False
    stream_options: StreamOptions | None = None  # with `stream` only
    stop: NonEmpty | list[NonEmpty] | None = None
    seed: Seed | None = None
    presence_penalty: Annotated[float, Strict(), bounds("presence_penalty")] | None = None
    frequency_penalty: Annotated[float, Strict(), bounds("frequency_penalty")] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions
    repetition_penalty: Annotated[float, Strict(), bounds("repetition_penalty")] | None = None
    return_tokens_as_token_ids: Bool = False  # logprobs name tokens "token_id:<id>", as vLLM can
    top_k: Annotated[int, Strict(), bounds("top_k"), WHOLE] | None = None
    min_tokens: Annotated[int, Strict(), bounds("min_tokens"), WHOLE] = 0
    ignore_eos: Bool = False
    stop_token_ids: list[TokenId] | None = None
    priority: Priority = 0

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(top alternatives per sampled token, per prompt token); None: not asked."""
        return None, None

    def generation(self) -> GenerationRequest:
        logprobs, prompt_logprobs = self.logprob_counts()
        sampling = SamplingSpec(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            min_tokens=self.min_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return GenerationRequest(self.model, sampling, self.requested_max_tokens(), stop, self.n, self.stream,
                                 self.priority, self.response_format)


LogprobCount = Annotated[int, Strict(), bounds("logprobs"), WHOLE]


class ChatCompletionRequest(OpenAIRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        STREAM_OPTIONS_NEED_STREAM,
        when("top_logprobs", {"type": "integer"}, needs("logprobs", True)),
        when("tool_choice", FORCED_CALL, NEEDS_TOOLS),
        when("tool_choice", FORCED_CALL, {"properties": {"response_format": {
            "anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]}}}),
    ]})

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Strict(), bounds("max_tokens"), WHOLE] | None = None
    logprobs: Bool | None = None
    top_logprobs: LogprobCount | None = None  # needs `logprobs: true` (the route says so)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = True
    # reasoning models: "none" turns thinking off through the template's `enable_thinking`; the others turn
    # it on and reach the template as `reasoning_effort` (templates that grade effort read it)
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: Annotated[dict[str, Any], Field(json_schema_extra={"propertyNames": {
        "not": {"enum": sorted(RESERVED_VARIABLES)}}})] | None = None  # vLLM's: extra variables for the template

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(value or ()) & RESERVED_VARIABLES)
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields do")
        return value

    def template_variables(self) -> dict[str, Any]:
        """The chat template's extra variables this request sets (`reasoning_effort`, `chat_template_kwargs`)."""
        return effort_variables(self.reasoning_effort) | (self.chat_template_kwargs or {})

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` wins over the deprecated `max_tokens`, as in vLLM."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> Conversation:
        return Conversation(self.messages, self.tools, self.tool_choice, self.parallel_tool_calls,
                            self.template_variables())


Prompt = NonEmpty | Annotated[list[NonEmpty], Field(min_length=1, max_length=1)] | \
    Annotated[list[TokenId], Field(min_length=1)] | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                                                               Field(min_length=1, max_length=1)]


class CompletionRequest(OpenAIRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [STREAM_OPTIONS_NEED_STREAM]})

    prompt: Prompt  # one prompt per request: batched prompts are several requests
    echo: Bool = False  # the prompt comes back before the completion (with `logprobs`, its logprobs too)
    logprobs: LogprobCount | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str | list) for p in value):
            raise ValueError("only one prompt per request is supported (batched prompts: send several requests)")
        return value

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None

"""What /openapi.json says the gateway answers: every status code each route can return, with its body.

FastAPI documents the request bodies from their models but knows nothing of our answers: the routes
return ready-made JSON, errors are OpenAI error bodies raised from anywhere (a 422 never leaves the
gateway: validation errors are 400s), and a streamed completion is `text/event-stream`. So the
response bodies are declared here as models, and `document` rewrites the generated spec with them.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

from services.gateway.openapi_streams import STREAMS, stream_schema


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # documented fields; an extension may add more


class ErrorDetail(_Body):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Body):
    error: ErrorDetail


class PromptTokensDetails(_Body):
    cached_tokens: int  # prompt tokens the prefix cache held: their prefill was not run, nor charged


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    energy_j: float | None = None  # AFlex: joules the workers spent on the request


class FunctionCallOut(_Body):
    name: str
    arguments: str  # a JSON object's text


class ToolCallOut(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatMessageOut(_Body):
    role: Literal["assistant"]
    content: str | None  # None when the answer is only tool calls
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None  # a reasoning model's reasoning


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: list[TokenLogprob]


class ChatChoice(_Body):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None  # with `logprobs: true`
    finish_reason: str


class ChatCompletion(_Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(_Body):
    tokens: list[str]
    token_logprobs: list[float | None]  # with `echo`, the prompt's first token has none
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None  # with `logprobs: n`
    finish_reason: str


class Completion(_Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class OutputText(_Body):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class ResponseMessage(_Body):
    type: Literal["message"]
    id: str
    status: str
    role: Literal["assistant"]
    content: list[OutputText]


class ResponseFunctionCall(_Body):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


class ReasoningTextOut(_Body):
    type: Literal["reasoning_text"]
    text: str


class ResponseReasoning(_Body):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ReasoningTextOut]
    status: str


class ResponseUsage(_Body):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int
    energy_j: float | None = None  # AFlex: joules the workers spent on the request


class ResponseObject(_Body):
    """A `/v1/responses` answer (stateless; the request's settings are echoed in more fields)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete"]
    model: str
    output: list[ResponseReasoning | ResponseMessage | ResponseFunctionCall]
    usage: ResponseUsage | None
    error: None
    incomplete_details: dict[str, str] | None


class Model(_Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(_Body):
    object: Literal["list"]
    data: list[Model]


class Tokenized(_Body):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class Detokenized(_Body):
    prompt: str


class TokenizerInfo(_Body):
    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    add_bos_token: bool
    chat_template: str | None
    model_max_length: int
    vocab_size: int


class Health(_Body):
    status: Literal["ok"]


class Ready(_Body):
    status: Literal["ready", "not_ready"]
    scheduler: dict[str, Any] | None = None
    reason: str | None = None



class AnthropicErrorDetail(_Body):
    type: str
    message: str


class AnthropicErrorResponse(_Body):
    """The Messages API's routes answer errors in Anthropic's shape."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class AnthropicUsage(_Body):
    input_tokens: int  # prompt tokens not read from the cache (Anthropic's: the prompt is the two added)
    output_tokens: int
    cache_read_input_tokens: int  # prompt tokens the prefix cache held
    cache_creation_input_tokens: int
    energy_j: float | None = None  # AFlex's extension


class AnthropicTextBlock(_Body):
    type: Literal["text"]
    text: str


class AnthropicThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str


class AnthropicToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class AnthropicMessage(_Body):
    """A `/v1/messages` answer (Anthropic's Messages API, stateless)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicThinkingBlock | AnthropicTextBlock | AnthropicToolUseBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: AnthropicUsage


class TokenCount(_Body):
    input_tokens: int

# Why each error status can come back (the descriptions /openapi.json shows).
ERROR_STATUSES = {
    400: "invalid request: bad JSON, a field out of range, too long for the context",
    401: "missing or wrong API key (when the gateway has one)",
    404: "unknown model, or no such route",
    413: "request body larger than max_body_bytes",
    429: "the scheduler's queue is full (Retry-After)",
    500: "the request failed in the mesh",
    502: "the scheduler sent an invalid reply",
    503: "no scheduler, no workers ready, or the bus is down (Retry-After)",
    504: "no output within request_timeout_s",
}
GENERATION_ERRORS = (400, 401, 404, 413, 429, 500, 502, 503, 504)
# route (path, method) -> (200 body model, the error statuses it can answer, whether it can stream)
ROUTES: dict[tuple[str, str], tuple[type[BaseModel], tuple[int, ...], bool]] = {
    ("/health", "get"): (Health, (), False),
    ("/ready", "get"): (Ready, (503,), False),
    ("/v1/models", "get"): (ModelList, (401,), False),
    ("/v1/models/{model}", "get"): (Model, (401, 404), False),
    ("/v1/chat/completions", "post"): (ChatCompletion, GENERATION_ERRORS, True),
    ("/v1/completions", "post"): (Completion, GENERATION_ERRORS, True),
    ("/v1/responses", "post"): (ResponseObject, GENERATION_ERRORS, True),
    ("/v1/messages", "post"): (AnthropicMessage, GENERATION_ERRORS, True),
    ("/v1/messages/count_tokens", "post"): (TokenCount, (400, 401, 404, 413), False),
    ("/tokenize", "post"): (Tokenized, (400, 401, 404, 413), False),
    ("/detokenize", "post"): (Detokenized, (400, 401, 404, 413), False),
    ("/tokenizer_info", "get"): (TokenizerInfo, (401,), False),
}


def _cap_token_ids(schema: Any, vocab: int) -> None:
    """Token ids (non-negative integers) in `schema` bounded by the served model's vocabulary, as the route is."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer" and schema.get("minimum") == 0:
            schema["maximum"] = vocab - 1
        for value in schema.values():
            _cap_token_ids(value, vocab)
    elif isinstance(schema, list):
        for value in schema:
            _cap_token_ids(value, vocab)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _error_body(path: str) -> type[BaseModel]:
    if path == "/ready":
        return Ready
    return AnthropicErrorResponse if path.startswith("/v1/messages") else ErrorResponse


def document(app: FastAPI) -> None:
    """Give `app` an /openapi.json whose responses are the ones the routes really send."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        models: list[type[BaseModel]] = [ErrorResponse, AnthropicErrorResponse,
                                         *dict.fromkeys(m for m, _, _ in ROUTES.values()),
                                         *(m for m, _ in STREAMS.values())]
        for model in models:
            for name, schema in model.model_json_schema(ref_template="#/components/schemas/{model}").get(
                    "$defs", {}).items():
                schemas[name] = schema
            schemas[model.__name__] = {k: v for k, v in model.model_json_schema(
                ref_template="#/components/schemas/{model}").items() if k != "$defs"}
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        vocab = app.state.gateway.tokenizer.vocab_size  # token ids the served model has
        for name, field in (("CompletionRequest", "prompt"), ("DetokenizeRequest", "tokens")):
            _cap_token_ids(schemas[name]["properties"][field], vocab)
        for (path, method), (body, errors, streams) in ROUTES.items():
            operation = spec["paths"][path][method]
            ok: dict[str, Any] = {"application/json": {"schema": _ref(body)}}
            if streams:
                ok["text/event-stream"] = {"schema": stream_schema(path, _ref(STREAMS[path][0]), _ref(ErrorResponse))}
            operation["responses"] = {"200": {"description": "OK", "content": ok}} | {
                str(status): {"description": ERROR_STATUSES[status],
                              "content": {"application/json": {"schema": _ref(_error_body(path))}}}
                for status in errors}
        app.openapi_schema = spec
        return spec

    app.openapi = openapi  # type: ignore[method-assign]

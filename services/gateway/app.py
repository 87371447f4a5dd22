"""The gateway's FastAPI app and its server loop.

`create_app(settings, card, nc)` builds the app on an open NATS connection (tests use it directly);
`serve(settings)` opens the model card, connects to NATS and runs uvicorn on the same event loop until
`stop` is set or SIGTERM/SIGINT arrives, then closes the connection.

Token budget: without `max_tokens`/`max_completion_tokens`, a chat completion may use the rest of the
context, capped at `DEFAULT_CHAT_MAX_TOKENS`; a completion gets OpenAI's default of 16 tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import re
import time
import uuid
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import llguidance
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from nats.aio.client import Client
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from services.gateway import liveness, tokenize
from services.gateway import metrics as gateway_metrics
from services.gateway.body_limit import BodyLimit
from services.gateway.context import (
    Gateway,
    GatewayDep,
    check_api_key,
    check_model,
    new_gateway_id,
    render_chat,
)
from services.gateway.errors import (
    APIError,
    JSONResponse,
    install_error_handlers,
    invalid,
)
from services.gateway.generation import Generation
from services.gateway.logprobs import LogprobFormat
from services.gateway.messages_api import CountTokensRequest, MessagesRequest, MessageView
from services.gateway.messages_api import chat_request as messages_chat_request
from services.gateway.openai_schema import ChatCompletionRequest, CompletionRequest, _GenerationRequest
from services.gateway.openapi_doc import document
from services.gateway.reasoning import ReasoningSplitter, Start
from services.gateway.responses_api import ResponsesRequest, ResponseView, chat_request, response_events
from services.gateway.streaming import (
    SSE_HEADERS,
    ChoiceEvents,
    ChoiceStreamResponse,
    Extras,
    ResponseShape,
    collect,
    stream,
)
from services.gateway.tool_calling import ToolRequest, template_messages, tool_request
from shared import subjects
from shared.errors import InvalidRequestError, TokenizerError
from shared.lifecycle import stop_on_signals
from shared.messages import ProtocolError, SamplingSpec, SchedulerStatus, decode
from shared.model import structured
from shared.model.checkpoint import ModelCard, open_model_card
from shared.settings import GatewaySettings
from shared.transport import bus

log = logging.getLogger("aflex.gateway")

DEFAULT_CHAT_MAX_TOKENS = 1024  # cap on "the rest of the context" when a chat request gives no max
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
STATUS_TIMEOUT_S = 2.0  # /ready: how long the scheduler may take to answer

T = TypeVar("T")
MAX_PROMPT_LOGPROBS = 200_000  # an echoed prompt's entries x (alternatives + 1): they travel in one NATS message
REQUEST_ID = re.compile(r"[A-Za-z0-9_:-]{1,128}")  # a client's x-request-id: it becomes a NATS subject token


# -- probes ---------------------------------------------------------------------------------------

probes = APIRouter()


@probes.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@probes.get("/ready")
async def ready(gateway: GatewayDep) -> Response:
    try:
        data = await bus.request(gateway.nc, subjects.SCHED_STATUS, b"{}", STATUS_TIMEOUT_S)
        status = decode(SchedulerStatus, data)
    except (bus.BusError, ProtocolError, OSError) as exc:
        return JSONResponse({"status": "not_ready", "reason": str(exc)}, status_code=503,
                            headers={"Retry-After": "1"})
    except Exception as exc:  # nats raises its own types when the connection is down
        return JSONResponse({"status": "not_ready", "reason": f"NATS: {exc!r}"}, status_code=503,
                            headers={"Retry-After": "1"})
    body = {"status": "ready" if status.ready else "not_ready", "scheduler": status.model_dump(mode="json")}
    return JSONResponse(body, status_code=200 if status.ready else 503,
                        headers={} if status.ready else {"Retry-After": "1"})


# -- OpenAI API -----------------------------------------------------------------------------------

api = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])


def _model_entry(gateway: Gateway) -> dict[str, Any]:
    return {"id": gateway.served_model, "object": "model", "created": gateway.started, "owned_by": "aflex",
            "root": gateway.card.model_id, "parent": None, "max_model_len": gateway.max_seq_len}


@api.get("/models")
async def list_models(gateway: GatewayDep) -> Response:
    return JSONResponse({"object": "list", "data": [_model_entry(gateway)]})


@api.get("/models/{model:path}")
async def retrieve_model(model: str, gateway: GatewayDep) -> Response:
    check_model(gateway, model)
    return JSONResponse(_model_entry(gateway))


@api.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, gateway: GatewayDep) -> Response:
    _check_common(gateway, body)
    if not body.messages:
        raise invalid("messages must be a non-empty list", "messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("when using `top_logprobs`, `logprobs` must be set to true", "top_logprobs")
    tools, prompt_ids = await _chat_prompt(gateway, body)
    return await _generate(request, gateway, body, prompt_ids, chat=True, param="messages", tools=tools)


async def _chat_prompt(gateway: Gateway, body: ChatCompletionRequest) -> tuple[ToolRequest | None, list[int]]:
    """The request's tools, checked, and its conversation's prompt ids with them."""
    tools = tool_request(body)
    messages, variables = template_messages(body.messages, tools, gateway.tokenizer)
    variables |= body.template_variables()
    return tools, await run_in_threadpool(lambda: render_chat(gateway.tokenizer, messages, **variables))


@api.post("/responses")
async def responses(body: ResponsesRequest, request: Request, gateway: GatewayDep) -> Response:
    """OpenAI's Responses API, stateless (services.gateway.responses_api)."""
    chat = chat_request(body)
    _check_common(gateway, chat)
    tools, prompt_ids = await _chat_prompt(gateway, chat)
    return await _generate(request, gateway, chat, prompt_ids, chat=True, param="input", tools=tools, responses=body)


@api.post("/messages")
async def messages(body: MessagesRequest, request: Request, gateway: GatewayDep) -> Response:
    """Anthropic's Messages API, stateless (services.gateway.messages_api)."""
    chat = messages_chat_request(body)
    _check_common(gateway, chat)
    tools, prompt_ids = await _chat_prompt(gateway, chat)
    return await _generate(request, gateway, chat, prompt_ids, chat=True, param="messages", tools=tools,
                           messages=body)


@api.post("/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, gateway: GatewayDep) -> Response:
    """The input tokens a Messages request would have: its conversation and tools, rendered."""
    chat = messages_chat_request(body)
    check_model(gateway, chat.model)
    _, prompt_ids = await _chat_prompt(gateway, chat)
    return JSONResponse({"input_tokens": len(prompt_ids)})


@api.post("/completions")
async def completions(body: CompletionRequest, request: Request, gateway: GatewayDep) -> Response:
    _check_common(gateway, body)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise invalid("only one prompt per request is supported (batched prompts: send several requests)",
                          "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if "\x00" in prompt:
            raise invalid("the prompt holds a NUL character (\\u0000), which no prompt may contain", "prompt")
        prompt_ids = await run_in_threadpool(gateway.tokenizer.encode, prompt, True)
    else:
        prompt_ids = [int(t) for t in prompt]  # type: ignore[arg-type]  # list[int] here
        vocab = gateway.tokenizer.vocab_size
        if any(t >= vocab for t in prompt_ids):
            raise invalid(f"prompt token ids must be below the vocabulary size {vocab}", "prompt")
    if body.echo and body.logprobs is not None and len(prompt_ids) * (body.logprobs + 1) > MAX_PROMPT_LOGPROBS:
        raise invalid(f"echo with logprobs={body.logprobs} on {len(prompt_ids)} prompt tokens asks for more than "
                      f"{MAX_PROMPT_LOGPROBS} log-probabilities; ask for fewer alternatives", "logprobs")
    echo_text = None
    if body.echo:
        echo_text = prompt if isinstance(prompt, str) else await run_in_threadpool(gateway.tokenizer.decode, prompt_ids)
    return await _generate(request, gateway, body, prompt_ids, chat=False, param="prompt", echo_text=echo_text)


def _check_common(gateway: Gateway, body: _GenerationRequest) -> None:
    check_model(gateway, body.model)
    if body.stream_options is not None and not body.stream:
        raise invalid("Stream options can only be defined when `stream=True`.", "stream_options")


def _max_tokens(gateway: Gateway, body: _GenerationRequest, n_prompt: int, param: str, chat: bool) -> int:
    limit = gateway.max_seq_len
    if n_prompt == 0:
        raise invalid(f"the {param} must not be empty", param)
    requested = body.requested_max_tokens()
    if requested is None:
        room = limit - n_prompt
        if room < 1:
            raise invalid(f"This model's maximum context length is {limit} tokens. However, your {param} "
                          f"has {n_prompt} tokens. Please reduce the length of the {param}.", param,
                          code="context_length_exceeded")
        return min(room, DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_COMPLETION_MAX_TOKENS)
    if n_prompt + requested > limit:
        raise invalid(f"This model's maximum context length is {limit} tokens. However, you requested "
                      f"{n_prompt + requested} tokens ({n_prompt} in the {param}, {requested} in the completion). "
                      f"Please reduce the length of the {param} or completion.", param,
                      code="context_length_exceeded")
    return requested


async def _generate(request: Request, gateway: Gateway, body: _GenerationRequest, prompt_ids: list[int], *,
                    chat: bool, param: str, echo_text: str | None = None, tools: ToolRequest | None = None,
                    responses: ResponsesRequest | None = None, messages: MessagesRequest | None = None) -> Response:
    """Submit the request's choices and answer as a chat completion, a completion, (`responses`) a Response or
    (`messages`) an Anthropic message."""
    max_tokens = _max_tokens(gateway, body, len(prompt_ids), param, chat)
    think = gateway.think_tokens if chat else None  # completions answer as the text comes
    start = None if think is None else think.start(prompt_ids, gateway.tokenizer)
    grammar = await _grammar(gateway, body, tools, start)
    sampling = _checked(dataclasses.replace(body.sampling(max_tokens), grammar=grammar))
    client_id = request.headers.get("x-request-id")  # vLLM's: the request's id, echoed back
    kind = "resp" if responses is not None else "msg" if messages is not None else "chatcmpl" if chat else "cmpl"
    request_id = f"{kind}-{client_id or uuid.uuid4().hex}"
    if client_id is not None and not REQUEST_ID.fullmatch(client_id):
        raise invalid("the x-request-id header may hold 1 to 128 letters, digits, '-', '_' or ':'", "x-request-id")
    generations = [Generation(
        nc=gateway.nc, request_id=request_id if i == 0 else f"{request_id}~{i}", model_id=gateway.card.model_id,
        prompt_ids=prompt_ids, sampling=_choice_sampling(sampling, i), stop=body.stop_strings(),
        tokenizer=gateway.tokenizer, submit_timeout_s=gateway.settings.submit_timeout_s,
        token_timeout_s=gateway.settings.request_timeout_s, metrics=request.app.state.metrics,
        watch=gateway.schedulers, gateway_id=gateway.gateway_id,
        scheduler_silence_s=gateway.settings.scheduler_silence_s,
        failover_deadline_s=gateway.settings.failover_deadline_s, fork_of=request_id if i else "",
        priority=body.priority, reasoning=None if start is None else ReasoningSplitter(start, think),
    ) for i in range(body.n)]
    shape = ResponseShape(request_id, int(time.time()), body.model or gateway.served_model, chat)
    top_n = sampling.logprobs
    extras = [Extras(None if top_n is None else LogprobFormat(gateway.tokenizer, chat=chat, top_n=top_n,
                                                                as_ids=body.return_tokens_as_token_ids),
                     echo_text, tuple(prompt_ids), tools.functions if tools is not None and tools.parses else None,
                     reasoning=start is not None)
              for _ in generations]
    headers = {"X-Request-Id": client_id or request_id}
    view = None if responses is None else ResponseView(responses, shape.model, request_id)
    message = None if messages is None else MessageView(messages, shape.model, request_id)
    try:
        for generation in generations:  # choice 0 first: the others may share its prompt's KV
            await generation.submit()
    except BaseException as exc:
        for generation in generations:
            await generation.release("submit_failed")
        if isinstance(exc, APIError):
            exc.headers.update(headers)
        raise
    if body.stream:
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(include_usage and options and options.continuous_usage_stats)
        events = ChoiceEvents(generations)
        try:  # the status line waits for the first event: a request shed before it starts is a real 429
            first = await _unless_disconnected(request, events.next())
        except BaseException as exc:
            await events.close("client_disconnected")
            if isinstance(exc, APIError):
                exc.headers.update(headers)
            raise
        body_bytes = (response_events(view, events, first, extras[0].functions) if view is not None
                      else message.events(events, first, extras[0].functions, len(prompt_ids)) if message is not None
                      else stream(shape, events, first, include_usage, continuous, extras))
        return ChoiceStreamResponse(events, body_bytes, media_type="text/event-stream",
                                    headers={**SSE_HEADERS, **headers})
    try:
        result = await _unless_disconnected(request, collect(shape, generations, extras))
    except APIError as exc:
        exc.headers.update(headers)
        raise
    finally:
        for generation in generations:
            await asyncio.shield(generation.release("client_disconnected"))
    answer = view.from_chat(result) if view is not None else message.from_chat(result) if message is not None \
        else result
    return JSONResponse(answer, headers=headers)


def _checked(sampling: SamplingSpec) -> SamplingSpec:
    """`SamplingParams.validate` over the effective max_tokens (`_max_tokens`): the schema bounds each field,
    the rules across fields (min_tokens <= max_tokens) are the spec's, the same the scheduler applies."""
    try:
        return sampling.validate()
    except InvalidRequestError as exc:
        raise invalid(str(exc), exc.param) from None


async def _grammar(gateway: Gateway, body: _GenerationRequest, tools: ToolRequest | None,
                   start: Start | None) -> str | None:
    """The grammar of a forced tool call or of `response_format`, checked against the vocabulary (a bad
    schema is a 400 here); with a reasoning model (`start`), it applies after the reasoning block."""
    form = body.response_format
    param = "tools" if tools is not None and tools.choice in ("required", "function") else "response_format"
    rule = "start" if start is None else "answer"
    try:
        lark = tools.lark(rule, gateway.call_marker_ids) if tools is not None else None
        if lark is None and form is not None and form.type != "text":
            lark = structured.json_lark(form.type, form.json_schema.schema_ if form.json_schema else None, rule)
        if lark is None:
            return None
        if start is not None and gateway.think_tokens is not None:
            lark = gateway.think_tokens.grammar(lark, start)
        grammar = str(llguidance.LLMatcher.grammar_from_lark(lark))
        tokenizer = await run_in_threadpool(structured.llg_tokenizer, gateway.tokenizer, gateway.card.args.vocab_size)
        await run_in_threadpool(structured.check, grammar, tokenizer, param)
    except InvalidRequestError as exc:
        raise invalid(str(exc), exc.param or param) from None
    except ValueError as exc:  # llguidance: not a JSON Schema or grammar it can compile
        raise invalid(f"{param}: {exc}", param) from None
    return grammar


def _choice_sampling(sampling: SamplingSpec, index: int) -> SamplingSpec:
    """Choice `index` of n: its own seed (seed + index, as vLLM's n does), so each choice reproduces alone."""
    if index == 0 or sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=sampling.seed + index)


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Run `work`; if the client disconnects first, cancel it (the caller then cancels on the bus)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # a cancelled task says so only once it ran
    if task.cancelled():
        raise APIError(499, "client closed the request", code="client_closed_request")
    return task.result()


# -- app and server -------------------------------------------------------------------------------


def create_app(settings: GatewaySettings, card: ModelCard, nc: Client) -> FastAPI:
    if card.tokenizer is None:
        raise TokenizerError(f"{card.path} ships no tokenizer: the gateway needs one to serve text")
    app = FastAPI(title="AFlex gateway", version="1", default_response_class=JSONResponse)
    app.state.gateway = Gateway(settings, card, card.tokenizer, nc, settings.served_model_name or card.model_id,
                                int(time.time()), gateway_id=settings.gateway_id or new_gateway_id())
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_body_bytes=settings.max_body_bytes)
    document(app)
    gateway_metrics.install(app)
    app.include_router(probes)
    app.include_router(api)
    app.include_router(tokenize.router)
    return app


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: `serve()` owns SIGTERM/SIGINT and shuts down cleanly."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(settings: GatewaySettings, *, stop: asyncio.Event | None = None) -> None:
    """Run the gateway until `stop` is set (or SIGTERM/SIGINT in the main thread); then close NATS."""
    stop = stop or asyncio.Event()
    card = await asyncio.to_thread(open_model_card, settings.model)
    nc = await bus.connect(settings.nats_url, "aflex-gateway", user=settings.nats_user, password=settings.nats_password)
    try:
        app = create_app(settings, card, nc)
        await app.state.metrics.subscribe(nc)
        gateway: Gateway = app.state.gateway
        await gateway.schedulers.subscribe(nc)
        beats = asyncio.create_task(liveness.heartbeat_loop(nc, gateway.gateway_id, settings.heartbeat_s))
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                                lifespan="off", access_log=False,
                                timeout_graceful_shutdown=math.ceil(settings.drain_timeout_s))  # SIGTERM: streams end
        server = _Server(config)

        async def stop_when_asked() -> None:
            """SIGTERM: uvicorn closes the listener (no new connections) and lets open responses end, streams
            included, for up to drain_timeout_s."""
            await stop.wait()
            log.info("gateway %s draining: %d connections open, up to %g s", gateway.gateway_id,
                     len(server.server_state.connections), settings.drain_timeout_s)
            server.should_exit = True

        watcher = asyncio.create_task(stop_when_asked())
        try:
            log.info("gateway %s serving %s on http://%s:%d (NATS %s)", gateway.gateway_id, gateway.served_model,
                     settings.host, settings.port, settings.nats_url)
            with stop_on_signals(stop):
                await server.serve()
            if stop.is_set() and not server.server_state.tasks:
                log.info("gateway %s drained", gateway.gateway_id)
        finally:
            watcher.cancel()
            beats.cancel()
    finally:
        await bus.close(nc)

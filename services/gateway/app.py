"""The gateway's FastAPI app and its server loop.

`create_app(settings, card, nc)` builds the app on an open NATS connection (tests use it directly);
`serve(settings)` opens the model card, connects to NATS and runs uvicorn on the same event loop until
`stop` is set or SIGTERM/SIGINT arrives, then closes the connection. The routes check what is theirs to
check and render the prompt; `answering.generate` does the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from nats.aio.client import Client
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from services.gateway import liveness, tokenize
from services.gateway import metrics as gateway_metrics
from services.gateway.answering import generate
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
    JSONResponse,
    install_error_handlers,
    invalid,
)
from services.gateway.messages_api import CountTokensRequest, MessagesRenderer, MessagesRequest
from services.gateway.messages_api import chat_request as messages_chat_request
from services.gateway.openai_render import openai_dialect
from services.gateway.openai_schema import ChatCompletionRequest, CompletionRequest, GenerationRequest
from services.gateway.openapi_doc import document
from services.gateway.responses_api import ResponsesRenderer, ResponsesRequest, chat_request
from services.gateway.streaming import Dialect
from services.gateway.tool_calling import ToolRequest, template_messages, tool_request
from shared import subjects
from shared.errors import TokenizerError
from shared.lifecycle import stop_on_signals
from shared.messages import ProtocolError, SchedulerStatus, decode
from shared.model.checkpoint import ModelCard, open_model_card
from shared.settings import GatewaySettings
from shared.transport import bus

log = logging.getLogger("aflex.gateway")

STATUS_TIMEOUT_S = 2.0  # /ready: how long the scheduler may take to answer

MAX_PROMPT_LOGPROBS = 200_000  # an echoed prompt's entries x (alternatives + 1): they travel in one NATS message


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
    return await generate(request, gateway, body, prompt_ids, openai_dialect(gateway.tokenizer, body, chat=True),
                          tools=tools)


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
    dialect = Dialect("resp", True, "input", lambda answering: ResponsesRenderer(body, answering.identity))
    return await generate(request, gateway, chat, prompt_ids, dialect, tools=tools)


@api.post("/messages")
async def messages(body: MessagesRequest, request: Request, gateway: GatewayDep) -> Response:
    """Anthropic's Messages API, stateless (services.gateway.messages_api)."""
    chat = messages_chat_request(body)
    _check_common(gateway, chat)
    tools, prompt_ids = await _chat_prompt(gateway, chat)
    dialect = Dialect("msg", True, "messages",
                      lambda answering: MessagesRenderer(answering.identity, len(answering.prompt_ids)))
    return await generate(request, gateway, chat, prompt_ids, dialect, tools=tools)


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
    return await generate(request, gateway, body, prompt_ids, openai_dialect(gateway.tokenizer, body, chat=False),
                          echo_text=echo_text)


def _check_common(gateway: Gateway, body: GenerationRequest) -> None:
    check_model(gateway, body.model)
    if body.stream_options is not None and not body.stream:
        raise invalid("Stream options can only be defined when `stream=True`.", "stream_options")


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

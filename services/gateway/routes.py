"""The /v1 API: each route checks what is its own, maps its request to the answer path's, renders the prompt,
and hands over to `answering.generate` with its dialect (services.gateway.streaming.Dialect).

A new API is a route here, its request models, and a renderer of the answer's parts (docs/architecture.md).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from services.gateway.answering import generate
from services.gateway.context import Gateway, GatewayDep, check_api_key, check_model, render_chat
from services.gateway.errors import JSONResponse, invalid
from services.gateway.generation_request import Conversation, GenerationRequest
from services.gateway.messages_api import MESSAGES_DIALECT
from services.gateway.messages_schema import CountTokensRequest, MessagesRequest
from services.gateway.openai_render import openai_dialect
from services.gateway.openai_schema import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from services.gateway.responses_api import responses_dialect
from services.gateway.responses_schema import ResponsesRequest
from services.gateway.tool_calling import ToolRequest, template_messages, tool_request

MAX_PROMPT_LOGPROBS = 200_000  # an echoed prompt's entries x (alternatives + 1): they travel in one NATS message

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


async def _chat_prompt(gateway: Gateway, body: Conversation, generation: GenerationRequest | None = None
                       ) -> tuple[ToolRequest | None, list[int]]:
    """The conversation's tools, checked (against the request's `response_format`), and its prompt ids."""
    tools = tool_request(body, generation.response_format if generation is not None else None)
    messages, variables = template_messages(body.messages, tools, gateway.tokenizer)
    variables |= body.template_variables
    return tools, await run_in_threadpool(lambda: render_chat(gateway.tokenizer, messages, **variables))


def _check_openai(gateway: Gateway, body: OpenAIRequest) -> None:
    check_model(gateway, body.model)
    if body.stream_options is not None and not body.stream:
        raise invalid("Stream options can only be defined when `stream=True`.", "stream_options")


@api.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, gateway: GatewayDep) -> Response:
    _check_openai(gateway, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("when using `top_logprobs`, `logprobs` must be set to true", "top_logprobs")
    generation = body.generation()
    tools, prompt_ids = await _chat_prompt(gateway, body.conversation(), generation)
    return await generate(request, gateway, generation, prompt_ids, openai_dialect(gateway.tokenizer, body, chat=True),
                          tools=tools)


@api.post("/completions")
async def completions(body: CompletionRequest, request: Request, gateway: GatewayDep) -> Response:
    _check_openai(gateway, body)
    prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str | list) \
        else body.prompt
    if isinstance(prompt, str):
        prompt_ids = await run_in_threadpool(gateway.tokenizer.encode, prompt, True)
    else:
        prompt_ids = [int(t) for t in prompt]  # type: ignore[union-attr]  # token ids here
        vocab = gateway.tokenizer.vocab_size
        if any(t >= vocab for t in prompt_ids):
            raise invalid(f"prompt token ids must be below the vocabulary size {vocab}", "prompt")
    if body.echo and body.logprobs is not None and len(prompt_ids) * (body.logprobs + 1) > MAX_PROMPT_LOGPROBS:
        raise invalid(f"echo with logprobs={body.logprobs} on {len(prompt_ids)} prompt tokens asks for more than "
                      f"{MAX_PROMPT_LOGPROBS} log-probabilities; ask for fewer alternatives", "logprobs")
    echo_text = None
    if body.echo:
        echo_text = prompt if isinstance(prompt, str) else await run_in_threadpool(gateway.tokenizer.decode, prompt_ids)
    return await generate(request, gateway, body.generation(), prompt_ids,
                          openai_dialect(gateway.tokenizer, body, chat=False), echo_text=echo_text)


@api.post("/responses")
async def responses(body: ResponsesRequest, request: Request, gateway: GatewayDep) -> Response:
    """OpenAI's Responses API, stateless (services.gateway.responses_api)."""
    check_model(gateway, body.model)
    generation = body.generation()
    tools, prompt_ids = await _chat_prompt(gateway, body.conversation(), generation)
    return await generate(request, gateway, generation, prompt_ids, responses_dialect(body), tools=tools)


@api.post("/messages")
async def messages(body: MessagesRequest, request: Request, gateway: GatewayDep) -> Response:
    """Anthropic's Messages API, stateless (services.gateway.messages_api)."""
    check_model(gateway, body.model)
    generation = body.generation()
    tools, prompt_ids = await _chat_prompt(gateway, body.conversation(), generation)
    return await generate(request, gateway, generation, prompt_ids, MESSAGES_DIALECT, tools=tools)


@api.post("/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, gateway: GatewayDep) -> Response:
    """The input tokens a Messages request would have: its conversation and tools, rendered."""
    check_model(gateway, body.model)
    _, prompt_ids = await _chat_prompt(gateway, body.conversation())
    return JSONResponse({"input_tokens": len(prompt_ids)})

"""A checked request's answer: its token budget and grammar, its n choices submitted to the scheduler, and
the answer, whole or streamed, in the dialect of the API that asked (a `Dialect`: its renderer). This path
names no API: a new one is a route that maps its request and a renderer of the answer's parts.

Token budget: where the request sets none, a chat-like dialect may use the rest of the context, capped at
`DEFAULT_CHAT_MAX_TOKENS`; a plain completion gets OpenAI's default of 16 tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

import llguidance
from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from services.gateway.context import Gateway
from services.gateway.errors import APIError, JSONResponse, invalid
from services.gateway.generation import Generation
from services.gateway.generation_request import GenerationRequest
from services.gateway.parts import Reading, collect
from services.gateway.reasoning import ReasoningSplitter, Start
from services.gateway.streaming import (
    SSE_HEADERS,
    Answering,
    ChoiceEvents,
    ChoiceStreamResponse,
    Dialect,
    Identity,
    stream,
)
from services.gateway.tool_calling import ToolRequest
from shared.errors import InvalidRequestError
from shared.messages import SamplingSpec
from shared.model import structured

DEFAULT_CHAT_MAX_TOKENS = 1024  # cap on "the rest of the context" when a chat request gives no max
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
REQUEST_ID = re.compile(r"[A-Za-z0-9_:-]{1,128}")  # a client's x-request-id: it becomes a NATS subject token
T = TypeVar("T")


def _max_tokens(gateway: Gateway, body: GenerationRequest, n_prompt: int, param: str, chat: bool) -> int:
    limit = gateway.max_seq_len
    if n_prompt == 0:
        raise invalid(f"the {param} must not be empty", param)
    requested = body.max_tokens
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


async def generate(request: Request, gateway: Gateway, body: GenerationRequest, prompt_ids: list[int],
                   dialect: Dialect, *, echo_text: str | None = None, tools: ToolRequest | None = None) -> Response:
    """Submit the request's choices and answer in `dialect`, whole or streamed."""
    max_tokens = _max_tokens(gateway, body, len(prompt_ids), dialect.param, dialect.chat)
    think = gateway.think_tokens if dialect.chat else None  # completions answer as the text comes
    start = None if think is None else think.start(prompt_ids, gateway.tokenizer)
    grammar = await _grammar(gateway, body, tools, start)
    sampling = _checked(dataclasses.replace(body.sampled(max_tokens), grammar=grammar))
    client_id = request.headers.get("x-request-id")  # vLLM's: the request's id, echoed back
    request_id = f"{dialect.kind}-{client_id or uuid.uuid4().hex}"
    if client_id is not None and not REQUEST_ID.fullmatch(client_id):
        raise invalid("the x-request-id header may hold 1 to 128 letters, digits, '-', '_' or ':'", "x-request-id")
    generations = [Generation(
        nc=gateway.nc, request_id=request_id if i == 0 else f"{request_id}~{i}", model_id=gateway.card.model_id,
        prompt_ids=prompt_ids, sampling=_choice_sampling(sampling, i), stop=body.stop,
        tokenizer=gateway.tokenizer, submit_timeout_s=gateway.settings.submit_timeout_s,
        token_timeout_s=gateway.settings.request_timeout_s, metrics=request.app.state.metrics,
        watch=gateway.schedulers, gateway_id=gateway.gateway_id,
        scheduler_silence_s=gateway.settings.scheduler_silence_s,
        failover_deadline_s=gateway.settings.failover_deadline_s, fork_of=request_id if i else "",
        priority=body.priority, reasoning=None if start is None else ReasoningSplitter(start, think),
    ) for i in range(body.n)]
    identity = Identity(request_id, int(time.time()), body.model or gateway.served_model)
    renderer = dialect.renderer(Answering(identity, prompt_ids, generations, sampling))
    reading = Reading(tools.functions if tools is not None and tools.parses else None, sampling.logprobs is not None,
                      echo_text, tuple(prompt_ids), reasoning=start is not None)
    headers = {"X-Request-Id": client_id or request_id}
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
        events = ChoiceEvents(generations)
        try:  # the status line waits for the first event: a request shed before it starts is a real 429
            first = await _unless_disconnected(request, events.next())
        except BaseException as exc:
            await events.close("client_disconnected")
            if isinstance(exc, APIError):
                exc.headers.update(headers)
            raise
        return ChoiceStreamResponse(events, stream(renderer, events, first, reading), media_type="text/event-stream",
                                    headers={**SSE_HEADERS, **headers})
    try:
        answers = await _unless_disconnected(request, collect(reading, generations))
    except APIError as exc:
        exc.headers.update(headers)
        raise
    finally:
        for generation in generations:
            await asyncio.shield(generation.release("client_disconnected"))
    return JSONResponse(renderer.whole(answers), headers=headers)


def _checked(sampling: SamplingSpec) -> SamplingSpec:
    """`SamplingParams.validate` over the effective max_tokens (`_max_tokens`): the schema bounds each field,
    the rules across fields (min_tokens <= max_tokens) are the spec's, the same the scheduler applies."""
    try:
        return sampling.validate()
    except InvalidRequestError as exc:
        raise invalid(str(exc), exc.param) from None


async def _grammar(gateway: Gateway, body: GenerationRequest, tools: ToolRequest | None,
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
    return dataclasses.replace(sampling, seed=(sampling.seed + index + 2**63) % 2**64 - 2**63)  # stays 64-bit


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

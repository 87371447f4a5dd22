"""`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`, with vLLM's request and response fields.

Clients (lm-evaluation-harness, vLLM's benchmark tools) count and split prompts here when the server
has these routes. `tokenize` takes a `prompt`, or `messages` rendered with the chat template exactly
as /v1/chat/completions renders them; it returns the ids the mesh would be fed. Like /v1, they ask
for the API key when one is set (vLLM leaves them open). `tokenizer_info` (vLLM's, behind its
`--enable-tokenizer-info-endpoint`) is what lets lm-evaluation-harness tokenize through the server
(`tokenizer_backend=remote`, which it picks by itself when the route answers) instead of loading the
model's tokenizer locally.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import ConfigDict, Field, Strict
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from services.gateway.api_model import APIModel, Bool, TokenId
from services.gateway.context import GatewayDep, check_api_key, check_model, render_chat
from services.gateway.conversation_schema import ChatMessage
from services.gateway.errors import JSONResponse, invalid
from services.gateway.tool_calling import template_messages

router = APIRouter(dependencies=[Depends(check_api_key)])


class TokenizeRequest(APIModel):
    """vLLM's `TokenizeCompletionRequest` (`prompt`) or `TokenizeChatRequest` (`messages`): exactly one."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}}]})

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: Bool = True
    return_token_strs: Bool = False


class DetokenizeRequest(APIModel):
    model: str | None = None
    tokens: Annotated[list[TokenId], Strict()] = Field(max_length=1 << 20)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, gateway: GatewayDep) -> Response:
    check_model(gateway, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise invalid("give exactly one of `prompt` and `messages`", "prompt" if body.prompt is None else "messages")
    tokenizer = gateway.tokenizer
    if body.messages is not None:
        messages, _ = template_messages(body.messages, None, tokenizer)
        ids = await run_in_threadpool(lambda: render_chat(tokenizer, messages,
                                                          add_generation_prompt=body.add_generation_prompt,
                                                          add_special_tokens=bool(body.add_special_tokens)))
    else:
        assert body.prompt is not None
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await run_in_threadpool(tokenizer.encode, body.prompt, special)
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": gateway.max_seq_len, "tokens": ids}
    if body.return_token_strs:
        answer["token_strs"] = [tokenizer.backend.id_to_token(i) for i in ids]
    return JSONResponse(answer)


@router.get("/tokenizer_info")
async def tokenizer_info(gateway: GatewayDep) -> Response:
    tokenizer = gateway.tokenizer
    return JSONResponse({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
                         "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token,
                         "unk_token": tokenizer.unk_token, "add_bos_token": tokenizer.add_bos_token,
                         "chat_template": tokenizer.chat_template, "model_max_length": gateway.max_seq_len,
                         "vocab_size": tokenizer.vocab_size})


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, gateway: GatewayDep) -> Response:
    check_model(gateway, body.model)
    vocab = gateway.tokenizer.vocab_size
    if any(t >= vocab for t in body.tokens):
        raise invalid(f"token ids must be below the vocabulary size {vocab}", "tokens")
    text = await run_in_threadpool(gateway.tokenizer.decode, body.tokens, False)
    return JSONResponse({"prompt": text})

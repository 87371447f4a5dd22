"""What every gateway route needs: the `Gateway` (settings, model card, tokenizer, NATS), the API-key
check, the model-name check and the chat template, shared by the OpenAI routes and /tokenize."""

from __future__ import annotations

import functools
import secrets
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request
from nats.aio.client import Client

from services.gateway.errors import AUTHENTICATION, NOT_FOUND, APIError, invalid
from services.gateway.liveness import SchedulerWatch
from services.gateway.reasoning import ThinkTokens
from services.gateway.tool_call_syntax import CLOSE, OPEN
from shared.errors import InvalidRequestError, TokenizerError
from shared.model.checkpoint import ModelCard
from shared.model.tokenizer import Tokenizer
from shared.settings import GatewaySettings


def new_gateway_id() -> str:
    return f"gw-{uuid.uuid4().hex[:8]}"


@dataclass
class Gateway:
    """What every route needs: settings, the model card and the NATS connection."""

    settings: GatewaySettings
    card: ModelCard
    tokenizer: Tokenizer
    nc: Client
    served_model: str
    started: int
    schedulers: SchedulerWatch = field(default_factory=SchedulerWatch)  # subscribed by `serve`
    gateway_id: str = field(default_factory=new_gateway_id)  # this run's

    @functools.cached_property
    def think_tokens(self) -> ThinkTokens | None:
        """The reasoning markers, where the served model reasons (services.gateway.reasoning)."""
        return ThinkTokens.of(self.tokenizer)

    @functools.cached_property
    def call_marker_ids(self) -> tuple[int, int] | None:
        """`<tool_call>` and `</tool_call>` where they are tokens of the vocabulary (a forced call names them)."""
        open_id, close_id = self.tokenizer.token_to_id(OPEN), self.tokenizer.token_to_id(CLOSE)
        return None if open_id is None or close_id is None else (open_id, close_id)

    @property
    def max_seq_len(self) -> int:
        return self.card.args.max_seq_len


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


GatewayDep = Annotated[Gateway, Depends(_gateway)]


def check_api_key(request: Request) -> None:
    keys = _gateway(request).settings.api_keys
    if not keys:
        return
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if "x-api-key" in request.headers:  # Anthropic's clients send the key so
        scheme, key = "bearer", request.headers["x-api-key"]
    given = key.strip().encode()
    # every key compared, in constant time each: which one matched (or none) does not show in the timing
    matches = [secrets.compare_digest(given, expected.encode()) for expected in keys]
    if scheme.lower() != "bearer" or not any(matches):
        raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>` (or `x-api-key`).",
                       type=AUTHENTICATION, code="invalid_api_key")


def check_model(gateway: Gateway, model: str | None) -> None:
    if model is not None and model not in (gateway.served_model, gateway.card.model_id):
        raise APIError(404, f"The model `{model}` does not exist.", type=NOT_FOUND, param="model",
                       code="model_not_found")


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                add_special_tokens: bool = False, **variables: Any) -> list[int]:
    """The conversation's prompt ids; `variables` (`tools`, ...) reach the template."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **variables)
    except InvalidRequestError as exc:
        raise invalid(str(exc), exc.param or "messages") from None
    except TokenizerError as exc:
        raise invalid(str(exc), "messages") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:  # the template on the client's
        # values (`chat_template_kwargs`, a turn's fields) failing inside the template's own code
        raise invalid(f"the chat template cannot render this conversation: {type(exc).__name__}: {exc}",
                      "messages") from None
    # The rendered template carries its own BOS when the model wants one: by default add no special tokens.
    return tokenizer.encode(text, add_special_tokens)

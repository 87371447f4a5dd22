"""Admission checks of a submitted request, without torch.

The gateway validates too, but the scheduler is the one that knows the workers' real capacity
(KV blocks x block size, context length from `Register`), and other clients may submit directly.
Each check raises `InvalidRequestError(message, param)`, which becomes a typed 400 rejection.
"""

from __future__ import annotations

import math

from shared.errors import InvalidRequestError
from shared.messages import SamplingSpec, SubmitRequest


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_sampling(spec: SamplingSpec) -> None:
    """The same ranges as `SamplingParams.validate` (which imports torch, so is not used here)."""
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        value = getattr(spec, name)
        if not math.isfinite(value):
            raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", name)
    if not 0.0 <= spec.temperature <= 2.0:
        raise InvalidRequestError(f"temperature must be in [0, 2], got {spec.temperature}", "temperature")
    if not 0.0 < spec.top_p <= 1.0:
        raise InvalidRequestError(f"top_p must be in (0, 1], got {spec.top_p}", "top_p")
    if spec.top_k < -1:
        raise InvalidRequestError(f"top_k must be -1, 0 (off) or a positive integer, got {spec.top_k}", "top_k")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(spec, name)
        if not -2.0 <= value <= 2.0:
            raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", name)
    if spec.max_tokens < 1:
        raise InvalidRequestError(f"max_tokens must be >= 1, got {spec.max_tokens}", "max_tokens")
    if not 0 <= spec.min_tokens <= spec.max_tokens:
        raise InvalidRequestError(f"min_tokens must be in [0, max_tokens={spec.max_tokens}], got {spec.min_tokens}",
                                  "min_tokens")
    for token_id in spec.stop_token_ids:
        if not _is_int(token_id) or token_id < 0:
            raise InvalidRequestError(f"stop_token_ids must be non-negative integers, got {token_id!r}",
                                      "stop_token_ids")


def validate_request(req: SubmitRequest, *, context_limit: int, vocab_size: int | None = None) -> None:
    """Raise `InvalidRequestError` if `req` cannot run on a worker holding `context_limit` tokens."""
    if not req.prompt_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in req.prompt_ids):
        raise InvalidRequestError(f"prompt token ids must lie in [0, {vocab_size})", param="prompt")
    validate_sampling(req.sampling)
    total = len(req.prompt_ids) + req.sampling.max_tokens
    if total > context_limit:
        raise InvalidRequestError(
            f"prompt ({len(req.prompt_ids)} tokens) plus max_tokens ({req.sampling.max_tokens}) is {total} tokens, "
            f"more than the {context_limit} tokens a worker can hold", param="max_tokens")

"""Admission checks of a submitted request, without torch.

The gateway validates too, but the scheduler is the one that knows the workers' real capacity
(KV blocks x block size, context length from `Register`), and other clients may submit directly.
Each check raises `InvalidRequestError(message, param)`, which becomes a typed 400 rejection.
"""

from __future__ import annotations

from shared.errors import InvalidRequestError
from shared.messages import SamplingSpec, SubmitRequest


def validate_sampling(spec: SamplingSpec) -> None:
    """The ranges of `SamplingParams.validate` (torch-free), on the spec as it travels."""
    spec.to_params().validate()


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

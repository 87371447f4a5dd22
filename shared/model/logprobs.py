"""Log-probabilities of given tokens and their top alternatives, from the raw logits, in float32.

OpenAI's `logprobs` and vLLM's `prompt_logprobs` are read off the logits the forward pass already
made (the sampled rows, and for an echoed prompt the prefill's rows): no second pass. Like vLLM's
default (`raw_logprobs`) they describe the model's distribution, before temperature, penalties or
top-k/top-p, so they do not depend on the sampling settings. A -inf (a token the model can never
produce) is reported as `FLOOR_LOGPROB`, as vLLM does, so that it survives JSON.
"""

from __future__ import annotations

import torch
from torch import Tensor

FLOOR_LOGPROB = -9999.0

# (the token's log-probability, the top alternatives' ids, their log-probabilities), best first
TokenLogprobs = tuple[float, list[int], list[float]]


def log_softmax_rows(logits: Tensor) -> Tensor:
    """The rows as float32 log-probabilities (a prompt chunk's last row is kept so until its target comes)."""
    # logits: [N, V] -> [N, V] float32
    return torch.log_softmax(logits.float(), dim=-1).clamp_(min=FLOOR_LOGPROB)


def pick(logp: Tensor, token_ids: Tensor, top_n: int) -> list[TokenLogprobs]:
    """For each row r of log-probabilities: logp[r, token_ids[r]] and the `top_n` most likely tokens."""
    # logp: [N, V], token_ids: [N] -> N entries
    if logp.shape[0] == 0:
        return []
    chosen = logp.gather(1, token_ids.long().unsqueeze(1)).squeeze(1).tolist()  # [N]
    if top_n <= 0:
        return [(lp, [], []) for lp in chosen]
    top = logp.topk(min(top_n, logp.shape[-1]), dim=-1)  # values, indices: [N, top_n]
    return list(zip(chosen, top.indices.tolist(), top.values.tolist(), strict=True))


def token_logprobs(logits: Tensor, token_ids: Tensor, top_n: int) -> list[TokenLogprobs]:
    """`pick` on raw logits."""
    # logits: [N, V], token_ids: [N]
    return pick(log_softmax_rows(logits), token_ids, top_n)

"""The logprobs a microbatch owes: the sampled tokens' and, for an echoed prompt, the prompt's.

Both come from the logits of the pass that runs anyway. A sampled token's row is the one it was
sampled from. A prompt token's logprob is read off the row before it: within a chunk that row is in
the same pass; the first token of a later chunk is predicted by the previous chunk's last row, which
the sequence keeps (`held`, [1, V] float32) until that chunk comes. Nothing is computed for a
sequence that asks for none, and the prompt's rows go through the lm_head only when asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from services.attention_worker.sequences import Admitted
from shared.messages import TokenLogprob
from shared.model.attention import AttentionHalf
from shared.model.logprobs import TokenLogprobs, log_softmax_rows, pick, token_logprobs
from shared.model.sampling import SequenceSampler

SLICE_ROWS = 256  # prompt rows through the lm_head at once (x the vocabulary, float32)


@dataclass
class PromptPart:
    """One sequence's prompt logprobs from one pass: entries for positions `start`, `start + 1`, ..."""

    start: int
    entries: list[TokenLogprob]
    held: Tensor | None  # the pass's last row, until the next chunk brings its target; None once sampled


def message(entry: TokenLogprobs) -> TokenLogprob:
    logprob, top_ids, top_logprobs = entry
    return TokenLogprob(logprob=logprob, top_ids=top_ids, top_logprobs=top_logprobs)


def wants_prompt_logprobs(item: Admitted) -> bool:
    """Still in the prompt (nothing sampled yet: a recompute after output has it already) and asked."""
    sampler = item.state.sampler
    return sampler.params.prompt_logprobs is not None and sampler.num_generated == 0


def sampled_logprobs(logits: Tensor, samplers: Sequence[SequenceSampler], tokens: Sequence[int]
                     ) -> list[TokenLogprob | None]:
    """Per sampled row: the token's logprob and top alternatives, or None where none were asked."""
    # logits: [B', V], one row per sampler
    asked = [i for i, s in enumerate(samplers) if s.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(samplers)
    if not asked:
        return out
    rows = torch.tensor(asked, device=logits.device)
    picked = torch.tensor([tokens[i] for i in asked], device=logits.device)
    top_n = max(samplers[i].params.logprobs or 0 for i in asked)  # one topk for all, cut per row
    for i, entry in zip(asked, token_logprobs(logits.index_select(0, rows), picked, top_n), strict=True):
        out[i] = message(_cut(entry, samplers[i].params.logprobs or 0))
    return out


def prompt_parts(model: AttentionHalf, residual: Tensor, ffn_out: Tensor, admitted: Sequence[Admitted]
                 ) -> dict[int, PromptPart]:
    """For each admitted sequence (by index) that wants prompt logprobs: this pass's part of them."""
    parts: dict[int, PromptPart] = {}
    row = 0
    for index, item in enumerate(admitted):
        n_new = len(item.work.token_ids)
        if wants_prompt_logprobs(item):
            top_n = item.state.sampler.params.prompt_logprobs or 0
            ids = torch.tensor(item.work.token_ids, device=residual.device)  # [n_new]
            start = item.work.start_pos + 1
            entries: list[TokenLogprobs] = []
            if item.state.held is not None and item.work.start_pos > 0:
                entries += pick(item.state.held, ids[:1], top_n)
                start = item.work.start_pos
            held = None
            for lo in range(0, n_new, SLICE_ROWS):  # [rows, V] at a time: a long chunk's logits stay small
                hi = min(lo + SLICE_ROWS, n_new)
                rows = torch.arange(row + lo, row + hi, device=residual.device)
                logp = log_softmax_rows(model.logits(residual, ffn_out, rows))  # [hi - lo, V]
                targets = ids[lo + 1:hi + 1]  # row p predicts token p + 1 (the chunk's last row: none here)
                entries += pick(logp[:len(targets)], targets, top_n)
                if hi == n_new and not item.work.sample:
                    held = logp[-1:].clone()
            parts[index] = PromptPart(start, [message(e) for e in entries], held)
        row += n_new
    return parts


def _cut(entry: TokenLogprobs, top_n: int) -> TokenLogprobs:
    logprob, top_ids, top_logprobs = entry
    return logprob, top_ids[:top_n], top_logprobs[:top_n]

"""Prompts of exactly the asked number of tokens for the server's tokenizer.

- `ids` (with `--tokenizer`): token-id prompts on `/v1/completions` (AFlex, vLLM and SGLang take a
  list of ids as `prompt`). Ids are drawn at random per request (seeded), never a special or added
  token, so the length is exact by construction and no two prompts share a cached prefix.
- `text` (any server, and the chat endpoint): a per-request number then " the" repeated; the server
  is asked (two 1-token requests) how many tokens such a prompt has, which gives the offset of the
  template and prefix, and the repeat count is solved for each length. The prompt lengths the server
  reports during the run are checked against the asked ones (`prompt_len_mismatches`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from loadgen.workloads import RequestSpec
from shared.errors import AFlexError

Prompt = str | list[int]
WORD = " the"


class PromptError(AFlexError):
    """No way to build prompts of the asked length."""


def usable_token_ids(tokenizer_spec: str) -> np.ndarray:
    """Ids of the tokenizer's ordinary tokens (special and added tokens left out)."""
    from shared.model.checkpoint import open_model_card

    card = open_model_card(tokenizer_spec)
    tokenizer = card.tokenizer
    if tokenizer is None:
        raise PromptError(f"{tokenizer_spec} ships no tokenizer")
    vocab = tokenizer.vocab_size
    excluded = {i for i in (tokenizer.bos_token_id, tokenizer.pad_token_id, *tokenizer.eos_token_ids)
                if i is not None}
    added = getattr(tokenizer.backend, "get_added_tokens_decoder", None)
    if added is not None:
        excluded.update(int(i) for i in added())
    ids = np.array([i for i in range(vocab) if i not in excluded], dtype=np.int64)
    if ids.size == 0:
        raise PromptError(f"{tokenizer_spec}: no ordinary tokens")
    return ids


def id_prompts(specs: Sequence[RequestSpec], ids: np.ndarray, seed: int = 0) -> list[Prompt]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.choice(ids, size=spec.input_len)] for spec in specs]


def text_prompt(index: int, repeats: int) -> str:
    return f"{index % 1_000_000:06d}:" + WORD * max(repeats, 0)


async def text_prompts(specs: Sequence[RequestSpec], count_tokens: Callable[[str], Awaitable[int]]
                       ) -> tuple[list[Prompt], int]:
    """Calibrated text prompts, and the shortest prompt the server can be given this way."""
    k1, k2 = 8, 40
    n1 = await count_tokens(text_prompt(0, k1))
    n2 = await count_tokens(text_prompt(0, k2))
    per_word = (n2 - n1) / (k2 - k1)
    if per_word <= 0:
        raise PromptError(f"text calibration failed: {k1} and {k2} words gave {n1} and {n2} tokens")
    offset = n1 - per_word * k1
    prompts: list[Prompt] = [text_prompt(s.index, round((s.input_len - offset) / per_word)) for s in specs]
    return prompts, round(offset)

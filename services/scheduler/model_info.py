"""What the scheduler needs to know of the served model: id, EOS ids, vocabulary, context size, shape.

Read from the model card (`SchedulerSettings.model`, env `AFLEX_MODEL`), never from tensors, so
the scheduler runs without torch. EOS ids let the scheduler end a request on the same token the
attention worker's sampler stops on.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.model.config import ModelArgs


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    eos_token_ids: frozenset[int]
    vocab_size: int | None = None
    max_seq_len: int | None = None
    args: ModelArgs | None = None  # the model's shape, for the aflex clock policy's predictors


def load_model_info(spec: str) -> ModelInfo:
    """Open the model card of `spec` (`default`, a .gguf file or an HF directory)."""
    from shared.model.checkpoint import open_model_card

    card = open_model_card(spec)
    eos = card.tokenizer.eos_token_ids if card.tokenizer is not None else card.args.eos_token_ids
    return ModelInfo(card.model_id, frozenset(eos) | frozenset(card.args.eos_token_ids),
                     card.args.vocab_size, card.args.max_seq_len, card.args)

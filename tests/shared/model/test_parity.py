"""The split engine, the unsplit forward and `transformers` agree, for every architecture.

Greedy tokens must be identical; float32 logits must agree closely. The split engine runs with a
small KV block size so that sequences span several blocks, and with microbatches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine import Engine, forward_unsplit
from shared.model.checkpoint import open_checkpoint
from shared.model.sampling import SamplingParams
from tests.conftest import ARCHITECTURES

PROMPT = [5, 17, 33, 101, 7, 250, 11, 64, 3]
NEW_TOKENS = 16


def _hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _engine(path: Path, **kwargs: int) -> Engine:
    return Engine.from_checkpoint(open_checkpoint(str(path)), **{"num_kv_blocks": 64, "block_size": 4, **kwargs})


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_tokens_match_transformers(arch: str, tiny_checkpoints: dict[str, Path]) -> None:
    hf = _hf_model(tiny_checkpoints[arch])
    hf.generation_config.eos_token_id = None  # like ignore_eos: never stop early, never mask EOS
    with torch.no_grad():
        expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS,
                               do_sample=False)[0, len(PROMPT):].tolist()
    engine = _engine(tiny_checkpoints[arch])
    split_tokens = engine.generate([PROMPT], GREEDY)[0].token_ids
    unsplit_tokens: list[int] = []
    for _ in range(NEW_TOKENS):
        logits = forward_unsplit(engine.attention, engine.ffn, PROMPT + unsplit_tokens)
        unsplit_tokens.append(int(logits[-1].argmax()))
    assert split_tokens == expected
    assert unsplit_tokens == expected


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_agree_with_transformers(arch: str, tiny_checkpoints: dict[str, Path]) -> None:
    """Prefill and every decode step of the split engine vs one full forward of the reference."""
    hf = _hf_model(tiny_checkpoints[arch])
    engine = _engine(tiny_checkpoints[arch])
    step_logits: list[torch.Tensor] = []
    run = engine._run

    def recording_run(scheduled):  # type: ignore[no-untyped-def]
        logits = run(scheduled)
        step_logits.append(logits[0].clone())
        return logits

    engine._run = recording_run  # type: ignore[method-assign]
    tokens = engine.generate([PROMPT], GREEDY)[0].token_ids
    full = PROMPT + tokens
    with torch.no_grad():
        reference = hf(torch.tensor([full])).logits[0]  # [S, V]
    unsplit = forward_unsplit(engine.attention, engine.ffn, full)
    positions = range(len(PROMPT) - 1, len(full) - 1)
    split = torch.stack(step_logits)
    assert split.shape == (NEW_TOKENS, reference.shape[-1])
    torch.testing.assert_close(split, reference[list(positions)], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(unsplit, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_chunked_prefill_and_microbatches_keep_tokens(arch: str, tiny_checkpoints: dict[str, Path]) -> None:
    """Prefill in chunks of 4 tokens and 3 microbatches give the plain engine's tokens."""
    prompts = [PROMPT, PROMPT[:4], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 12, 13, 14]]
    plain = _engine(tiny_checkpoints[arch]).generate(prompts, GREEDY)
    chunked = _engine(tiny_checkpoints[arch], max_batch_tokens=4, microbatches=3).generate(prompts, GREEDY)
    assert [c.token_ids for c in chunked] == [p.token_ids for p in plain]

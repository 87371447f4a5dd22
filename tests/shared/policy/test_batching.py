"""A sequence's tokens do not depend on what else shares its batch or microbatch."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.engine import Engine
from shared.model.checkpoint import open_checkpoint
from shared.model.sampling import SamplingParams

TARGET = [5, 17, 33, 101, 7, 250, 11, 64, 3]
OTHERS = [[1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53], [200], [9, 9, 9, 9, 9]]


def _engine(path: Path, **kwargs: int) -> Engine:
    return Engine.from_checkpoint(open_checkpoint(str(path)), **{"num_kv_blocks": 128, "block_size": 4, **kwargs})


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_tokens_independent_of_batch(arch: str, params: SamplingParams, tiny_checkpoints: dict[str, Path]) -> None:
    alone = _engine(tiny_checkpoints[arch]).generate([TARGET], params)[0].token_ids
    other_params = SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
    for microbatches in (1, 2, 3):
        engine = _engine(tiny_checkpoints[arch], microbatches=microbatches)
        mixed = engine.generate([*OTHERS[:2], TARGET, *OTHERS[2:]], [other_params] * 2 + [params]
                                + [other_params] * 2)
        assert mixed[2].token_ids == alone, f"microbatches={microbatches}"


def test_sequences_join_and_leave_between_steps(tiny_checkpoints: dict[str, Path]) -> None:
    """A sequence added while others decode gets the tokens it gets alone (continuous batching)."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    alone = _engine(tiny_checkpoints["qwen3"]).generate([TARGET], params)[0].token_ids
    engine = _engine(tiny_checkpoints["qwen3"])
    engine.add_request("early", OTHERS[1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()
    engine.step()
    engine.add_request("late", TARGET, params)
    tokens: list[int] = []
    finished: dict[str, str] = {}
    while engine.has_unfinished():
        for event in engine.step():
            if event.seq_id == "late":
                tokens.append(event.token_id)
            if event.finish_reason:
                finished[event.seq_id] = event.finish_reason
    assert tokens == alone
    assert finished == {"early": "length", "late": "length"}
    assert engine.block_tables.allocator.num_free_blocks == engine.block_tables.allocator.num_blocks


def test_preemption_when_kv_runs_out_keeps_tokens(tiny_checkpoints: dict[str, Path]) -> None:
    """With too few KV blocks for all sequences at once, preempted ones recompute and finish right."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [TARGET, *OTHERS]
    roomy = _engine(tiny_checkpoints["llama"]).generate(prompts, params)
    tight_engine = _engine(tiny_checkpoints["llama"], num_kv_blocks=12)
    tight = tight_engine.generate(prompts, params)
    assert [c.token_ids for c in tight] == [c.token_ids for c in roomy]
    assert tight_engine.num_preemptions > 0
    assert tight_engine.block_tables.allocator.num_free_blocks == 12

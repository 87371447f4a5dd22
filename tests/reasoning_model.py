"""A tiny Qwen3 that reasons: random weights, SmolLM2's tokenizer with `<think>`, `</think>` and the call
markers added, a template in Qwen3's format (tests/data/qwen3_style_chat_template.jinja), trained for a
few seconds until greedy decoding says each scripted answer to its prompt, token for token.

A random model never opens `<think>` of itself; this one was taught to, so the reasoning paths of all
three APIs run on a real checkpoint served by the real mesh. Prompts are rendered by AFlex's own template
code, as the gateway renders them; the answers are checked against transformers' greedy decoding here and
against the mesh's own raw completion in the tests.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.conftest import TEST_DATA

ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is 2+2?"}]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@dataclass(frozen=True)
class Script:
    """A prompt (messages and template variables) and the answer the model is taught to give it."""

    messages: list[dict[str, Any]]
    variables: dict[str, Any]
    answer: str


SCRIPTS = (
    Script(QUESTION, {}, "<think>\nTwo plus two makes four.\n</think>\n\nThe answer is 4.<|im_end|>"),
    Script(QUESTION, {"enable_thinking": False}, "The answer is 4.<|im_end|>"),
    Script(WEATHER_QUESTION, {"tools": [WEATHER_TOOL]},
           '<think>\nI should ask the weather tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
           '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'),
)
MAX_STEPS = 400
EXTRA_STEPS = 40  # after the first step at which every script comes out: wider margins for the engine's kernels


def make_reasoning_checkpoint(directory: Path, base_tokenizer: Any) -> Path:
    """Save the tokenizer and template, then train and save the model (about 10 s on two cores)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shared.model.tokenizer import Tokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    hf_tokenizer = copy.deepcopy(base_tokenizer)  # the session's, shared: left as it is
    hf_tokenizer.add_tokens(list(ADDED_TOKENS))
    hf_tokenizer.chat_template = (TEST_DATA / "qwen3_style_chat_template.jinja").read_text()
    hf_tokenizer.save_pretrained(directory)
    tokenizer = Tokenizer.from_hf_dir(directory)
    assert tokenizer is not None
    pairs = [(tokenizer.encode(tokenizer.apply_chat_template(s.messages, **s.variables)),
              tokenizer.encode(s.answer)) for s in SCRIPTS]
    config = AutoConfig.for_model(
        "qwen3", vocab_size=len(hf_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=hf_tokenizer.bos_token_id,
        eos_token_id=tokenizer.token_to_id("<|im_end|>"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _train(model, pairs)
    model.eval().save_pretrained(directory)
    return directory


def _train(model: Any, pairs: list[tuple[list[int], list[int]]]) -> None:
    """Adam on the answers' tokens only, until greedy decoding gives every answer, then `EXTRA_STEPS` more."""
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    learnt_at = None
    for step in range(MAX_STEPS):
        loss = torch.zeros(())
        for prompt, answer in pairs:
            ids = torch.tensor([prompt + answer])  # (1, T)
            hidden = model.model(ids).last_hidden_state[0, len(prompt) - 1:-1]  # (len(answer), D)
            loss = loss + torch.nn.functional.cross_entropy(model.lm_head(hidden), torch.tensor(answer))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if learnt_at is None and step % 10 == 9 and all(_greedy(model, p, len(a)) == a for p, a in pairs):
            learnt_at = step
        if learnt_at is not None and step >= learnt_at + EXTRA_STEPS:
            break
    if learnt_at is None or not all(_greedy(model, p, len(a)) == a for p, a in pairs):
        raise RuntimeError(f"the reasoning checkpoint did not learn its scripts in {MAX_STEPS} steps")


@torch.no_grad()
def _greedy(model: Any, prompt: list[int], n_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n_tokens, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()

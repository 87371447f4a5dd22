"""Prefix caching through the whole mesh with the official `openai` client (on by default): a
prompt whose prefix a worker holds starts from those KV blocks, reports them as
`usage.prompt_tokens_details.cached_tokens` and on /metrics, is charged only the prefill it ran, and
answers exactly as the uncached run (tokens and logprobs)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tools.launch import Mesh, aflex_up

BLOCK = 16  # the attention worker's default block_size
SYSTEM = "You are a careful assistant. " * 12  # a long shared system prompt: several full blocks
TOL = 1e-4


@pytest.fixture(scope="module")
def mesh(tiny_chat_checkpoint: Path) -> Iterator[Mesh]:
    with aflex_up(str(tiny_chat_checkpoint)) as running:  # the default settings: caching on
        yield running


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


def _ask(client: openai.OpenAI, question: str, **kw: Any) -> Any:
    messages: Any = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, max_tokens=8,
                                          temperature=0.0, logprobs=True, top_logprobs=2, **kw)


def _logprobs(r: Any) -> list[float]:
    return [t.logprob for t in r.choices[0].logprobs.content]


def test_a_repeated_prefix_is_taken_from_the_cache_and_answers_exactly(client: openai.OpenAI, mesh: Mesh) -> None:
    first = _ask(client, "Name a colour.")
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # nothing held yet
    again = _ask(client, "Name a colour.")
    n_prompt = again.usage.prompt_tokens
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == (n_prompt - 1) // BLOCK * BLOCK > 0  # every full block but the last token's
    assert again.choices[0].message.content == first.choices[0].message.content
    assert _logprobs(again) == pytest.approx(_logprobs(first), abs=TOL)
    # only the prefill it ran is charged
    assert again.usage.model_extra["energy_j"] < first.usage.model_extra["energy_j"]
    # another question after the same system prompt: the shared blocks only
    other = _ask(client, "Name a fruit, please, and say why you like it.")
    shared = other.usage.prompt_tokens_details.cached_tokens
    assert 0 < shared < other.usage.prompt_tokens
    fresh = _ask(client, "Name a fruit, please, and say why you like it.", extra_body={"repetition_penalty": 1.0001})
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0  # a repetition penalty computes its prompt
    text = httpx.get(mesh.base_url.removesuffix("/v1") + "/metrics").text
    hits = float(re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)", text, re.M).group(1))  # type: ignore
    queries = float(re.search(r"^vllm:prefix_cache_queries_total\{[^}]*\} (\S+)", text, re.M).group(1))  # type: ignore
    assert hits == cached + shared and queries >= hits


def test_streamed_usage_reports_cached_tokens(client: openai.OpenAI) -> None:
    _ask(client, "Count to three.")
    chunks = list(_ask(client, "Count to three.", stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details.cached_tokens > 0

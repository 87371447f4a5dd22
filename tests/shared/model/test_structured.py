"""Structured outputs in the sampler: llguidance's grammar masks each draw, on SmolLM2's real vocabulary."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from shared.errors import InvalidRequestError
from shared.model import structured
from shared.model.checkpoint import open_model_card
from shared.model.finish_rule import finish_reason
from shared.model.sampling import SamplingParams, SequenceSampler, sample_next_tokens
from shared.model.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    card = open_model_card("default")
    assert card.tokenizer is not None
    return card.tokenizer


def _run(tokenizer: Tokenizer, grammar: str, seed: int, params: SamplingParams) -> list[int]:
    constraint = structured.Constraint(structured.llg_tokenizer(tokenizer, 49152), grammar)
    sampler = SequenceSampler(params, tokenizer.eos_token_ids, constraint)
    noise = torch.Generator().manual_seed(seed)
    out: list[int] = []
    reason = None
    while reason is None:  # the finish rule as the scheduler applies it: before the token is recorded
        logits = torch.randn(1, 49152, generator=noise) * 4  # [1, V]: a model with no idea of JSON
        token = sample_next_tokens(logits, [sampler])[0]
        reason = finish_reason(params, sampler.num_generated, token, sampler.eos_token_ids, constrained=True)
        sampler.record(token)
        out.append(token)
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_draw_stays_inside_the_schema(tokenizer: Tokenizer, temperature: float) -> None:
    grammar = structured.grammar_for("json_schema", SCHEMA)
    assert grammar is not None
    for seed in range(5):
        ids = _run(tokenizer, grammar, seed, SamplingParams(temperature=temperature, seed=seed, max_tokens=60))
        assert ids[-1] in tokenizer.eos_token_ids  # it ends when the grammar does
        jsonschema.validate(json.loads(tokenizer.decode(ids)), SCHEMA)


def test_a_finished_grammar_ends_the_output_even_under_min_tokens(tokenizer: Tokenizer) -> None:
    """min_tokens holds EOS back, but not under a grammar: once the object is closed, EOS ends it (any
    other token would break the grammar, and the scheduler ends it on the same rule)."""
    grammar = structured.grammar_for("json_schema", SCHEMA)
    assert grammar is not None
    ids = _run(tokenizer, grammar, 0, SamplingParams(temperature=1.0, seed=0, max_tokens=100, min_tokens=99))
    assert ids[-1] in tokenizer.eos_token_ids and len(ids) < 99
    jsonschema.validate(json.loads(tokenizer.decode(ids)), SCHEMA)


def test_bad_formats_are_typed_errors(tokenizer: Tokenizer) -> None:
    assert structured.grammar_for("text") is None
    with pytest.raises(InvalidRequestError, match=r"json_schema\.schema"):
        structured.grammar_for("json_schema", None)
    with pytest.raises(InvalidRequestError, match=r"response_format\.type"):
        structured.grammar_for("yaml")
    bad = structured.grammar_for("json_schema", {"type": "objectx"})
    assert bad is not None
    with pytest.raises(InvalidRequestError, match="objectx"):
        structured.check(bad, structured.llg_tokenizer(tokenizer, 49152))


def test_ignore_eos_does_not_outlive_the_grammar(tokenizer: Tokenizer) -> None:
    """ignore_eos runs plain text to max_tokens; a closed grammar allows only EOS, so it ends there."""
    grammar = structured.grammar_for("json_schema", SCHEMA)
    assert grammar is not None
    ids = _run(tokenizer, grammar, 1, SamplingParams(temperature=1.0, seed=1, max_tokens=100, ignore_eos=True))
    assert ids[-1] in tokenizer.eos_token_ids and len(ids) < 100

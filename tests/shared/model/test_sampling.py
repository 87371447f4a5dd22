"""Sampling: reproducible per-sequence streams, exact penalties, finish rules and stop strings."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.errors import InvalidRequestError
from shared.kinds import FinishReason
from shared.model.finish_rule import finish_reason
from shared.model.sampling import (
    SamplingParams,
    SequenceSampler,
    StopStringMatcher,
    apply_penalties_,
    sample_next_tokens,
)

VOCAB = 32
EOS = 2


def _logits_stream(seed: int, steps: int, rows: int = 1, vocab: int = VOCAB) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, vocab, generator=gen) * 3 for _ in range(steps)]  # each: [rows, V]


def _run(params: SamplingParams, stream: list[torch.Tensor]) -> list[int]:
    sampler = SequenceSampler(params, eos_token_ids=(EOS,))
    tokens = []
    for logits in stream:
        tok = sample_next_tokens(logits, [sampler])[0]
        sampler.record(tok)
        tokens.append(tok)
    return tokens


# ---------------------------------------------------------------- reproducibility and batch independence

@pytest.mark.parametrize("params", [
    SamplingParams(seed=7, max_tokens=100),
    SamplingParams(seed=7, temperature=0.7, top_p=0.9, top_k=10, max_tokens=100),
    SamplingParams(seed=123, temperature=1.3, presence_penalty=0.5, frequency_penalty=0.3, max_tokens=100),
])
def test_seeded_sampling_is_reproducible(params: SamplingParams) -> None:
    stream = _logits_stream(0, 30)
    first = _run(params, stream)
    assert first == _run(params, stream)
    assert first != _run(SamplingParams(**{**params.__dict__, "seed": 8}), stream)


def test_a_sequence_samples_the_same_alone_or_in_any_batch() -> None:
    target = SamplingParams(seed=42, temperature=0.9, top_p=0.8, frequency_penalty=0.4, min_tokens=3,
                            max_tokens=100)
    steps = 25
    target_rows = _logits_stream(1, steps)  # each: [1, V]
    alone = _run(target, target_rows)

    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(seed=1),
        SamplingParams(seed=2, top_k=5, temperature=1.5),
        SamplingParams(temperature=0.0, presence_penalty=1.0, min_tokens=10, max_tokens=100),
        SamplingParams(top_p=0.3),  # unseeded
    ]
    for position in (0, 2, 5):
        samplers = [SequenceSampler(p, eos_token_ids=(EOS,)) for p in others]
        target_sampler = SequenceSampler(target, eos_token_ids=(EOS,))
        samplers.insert(position, target_sampler)
        noise = _logits_stream(100 + position, steps, rows=len(samplers))
        got = []
        for step in range(steps):
            logits = noise[step].clone()  # [B, V]
            logits[position] = target_rows[step][0]
            tokens = sample_next_tokens(logits, samplers)
            for s, tok in zip(samplers, tokens, strict=True):
                s.record(tok)
            got.append(tokens[position])
        assert got == alone, f"target at row {position}"


def test_each_row_runs_the_exponential_race_with_its_own_generators_noise() -> None:
    logits = _logits_stream(9, 1, rows=8, vocab=4096)[0]  # [8, V]
    samplers = [SequenceSampler(SamplingParams(seed=100 + i, temperature=0.8)) for i in range(8)]
    expected = []
    for i, s in enumerate(samplers):
        probs = torch.softmax(logits[i] / 0.8, dim=-1)  # [V]
        u = torch.empty(4096).uniform_(generator=s.generator(torch.device("cpu")))
        expected.append(int((probs / -torch.log(u)).argmax()))
    assert sample_next_tokens(logits, samplers) == expected


def test_a_seeded_draw_survives_rounding_in_the_logits() -> None:
    """A recompute elsewhere gives logits equal up to rounding: the seeded tokens must not move."""
    logits = _logits_stream(21, 1, rows=256, vocab=8192)[0]  # [256, V]
    wobble = 1 + 1e-5 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
    draws = []
    for rows in (logits, logits * wobble):
        draws.append(sample_next_tokens(rows, [SequenceSampler(SamplingParams(seed=i)) for i in range(256)]))
    assert draws[0] == draws[1]  # an inverse CDF with the same uniforms moves 4 of these 256 rows


def test_tokens_without_probability_are_never_drawn_even_at_the_edges() -> None:
    """Masked tokens (probability 0) at the start, between kept ones and at the end of the row."""
    logits = torch.full((1, 6), -math.inf)
    logits[0, 1], logits[0, 3] = 0.0, 0.0  # kept: 1 and 3
    drawn = {sample_next_tokens(logits, [SequenceSampler(SamplingParams(seed=i))])[0] for i in range(400)}
    assert drawn == {1, 3}


@pytest.mark.parametrize("params", [
    SamplingParams(seed=7, temperature=0.9),
    SamplingParams(seed=7, temperature=1.1, top_k=8, top_p=0.9, frequency_penalty=0.5),
])
def test_a_sampler_rebuilt_from_its_tokens_draws_what_the_first_would_have(params: SamplingParams) -> None:
    """A recompute elsewhere, or a resubmission to a new scheduler, continues the seeded stream exactly."""
    stream = _logits_stream(11, 12)
    whole = _run(params, stream)
    for cut in (1, 5, 11):
        rebuilt = SequenceSampler(params, eos_token_ids=(EOS,))
        for tok in whole[:cut]:  # what the worker does with a first pass's generated_ids
            rebuilt.record(tok)
        rest = []
        for logits in stream[cut:]:
            tok = sample_next_tokens(logits, [rebuilt])[0]
            rebuilt.record(tok)
            rest.append(tok)
        assert whole[:cut] + rest == whole, cut


def test_unseeded_sequences_get_their_own_streams() -> None:
    a = SequenceSampler(SamplingParams())
    b = SequenceSampler(SamplingParams())
    assert a.seed != b.seed


# ---------------------------------------------------------------- greedy and truncation

def test_greedy_is_argmax_and_fast_path_matches() -> None:
    logits = _logits_stream(3, 1, rows=16)[0]  # [16, V]
    expected = logits.argmax(dim=-1).tolist()
    greedy = [SequenceSampler(SamplingParams(temperature=0.0)) for _ in range(16)]
    assert sample_next_tokens(logits, greedy) == expected
    # Mixed batch (no fast path): the greedy rows still take the argmax.
    mixed = [SequenceSampler(SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i)) for i in range(16)]
    got = sample_next_tokens(logits, mixed)
    assert [got[i] for i in range(1, 16, 2)] == expected[1::2]


def test_top_k_one_and_tiny_top_p_equal_greedy() -> None:
    logits = _logits_stream(4, 1, rows=64)[0]  # [64, V]
    expected = logits.argmax(dim=-1).tolist()
    top_k1 = [SequenceSampler(SamplingParams(top_k=1, temperature=1.5, seed=i)) for i in range(64)]
    tiny_p = [SequenceSampler(SamplingParams(top_p=1e-6, temperature=1.5, seed=i)) for i in range(64)]
    assert sample_next_tokens(logits, top_k1) == expected
    assert sample_next_tokens(logits, tiny_p) == expected


def _empirical(logits_row: torch.Tensor, params: dict, draws: int) -> torch.Tensor:
    """Frequencies of `draws` independent samples: one row per draw, each with its own seed."""
    logits = logits_row.expand(draws, -1).contiguous()  # [draws, V]
    samplers = [SequenceSampler(SamplingParams(seed=i, **params)) for i in range(draws)]
    tokens = torch.tensor(sample_next_tokens(logits, samplers))
    return torch.bincount(tokens, minlength=logits.shape[-1]).float() / draws


LOGITS_5 = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temperature: float) -> None:
    freq = _empirical(LOGITS_5, {"temperature": temperature}, draws=6000)
    expected = torch.softmax(LOGITS_5 / temperature, dim=-1)
    assert torch.allclose(freq, expected, atol=0.025), (freq, expected)


def test_top_k_and_top_p_frequencies_match_renormalised_distribution() -> None:
    probs = torch.softmax(LOGITS_5, dim=-1)  # ~[.56, .21, .13, .08, .03]
    top2 = probs[:2] / probs[:2].sum()
    freq = _empirical(LOGITS_5, {"top_k": 2}, draws=6000)
    assert freq[2:].sum() == 0
    assert torch.allclose(freq[:2], top2, atol=0.025)
    # top_p=0.75: the smallest prefix with mass >= 0.75 is tokens {0, 1} (0.56 + 0.21).
    freq = _empirical(LOGITS_5, {"top_p": 0.75}, draws=6000)
    assert freq[2:].sum() == 0
    assert torch.allclose(freq[:2], top2, atol=0.025)
    # top_p just above that mass needs the third token too.
    freq = _empirical(LOGITS_5, {"top_p": float(probs[:2].sum()) + 0.01}, draws=3000)
    assert freq[3:].sum() == 0 and freq[2] > 0


def test_top_p_keeps_the_smallest_prefix_that_reaches_the_mass_exactly() -> None:
    # Four equal logits: probabilities are exactly 0.25, so {0, 1} reaches top_p=0.5 and token 2 is cut.
    freq = _empirical(torch.zeros(4), {"top_p": 0.5}, draws=400)
    assert freq[2:].sum() == 0 and freq[0] > 0 and freq[1] > 0


# ---------------------------------------------------------------- penalties

def test_penalties_follow_the_openai_formula_exactly() -> None:
    logits = _logits_stream(5, 1, rows=3)[0]  # [3, V]
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),  # no penalties: row untouched
        SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5),
    ]
    history = [[3, 3, 7, 3], [1, 1], [0, 9, 9]]
    samplers = [SequenceSampler(p) for p in params]
    for s, toks in zip(samplers, history, strict=True):
        for t in toks:
            s.record(t)
    expected = logits.clone()
    for r, (p, toks) in enumerate(zip(params, history, strict=True)):
        for t in set(toks):
            c = toks.count(t)
            expected[r, t] -= p.presence_penalty * (c > 0) + p.frequency_penalty * c
    got = logits.clone()
    apply_penalties_(got, [0, 2], samplers)
    assert torch.equal(got, expected)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    """vLLM's rule over the prompt (seen chunk by chunk) and the output, before the OpenAI penalties."""
    logits = torch.tensor([[2.0, -1.0, 3.0, -4.0, 1.0, 0.5]])  # [1, 6]
    sampler = SequenceSampler(SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5))
    sampler.saw([0, 1])
    sampler.saw([1])  # a later chunk, or a recompute feeding it again: each token counts once
    sampler.record(3)
    got = logits.clone()
    apply_penalties_(got, [0], [sampler])
    assert torch.equal(got, torch.tensor([[1.0, -2.0, 3.0, -8.0 - 0.5, 1.0, 0.5]]))
    assert sample_next_tokens(logits, [sampler]) == [2]
    assert sample_next_tokens(torch.tensor([[2.0, 0.0, 1.5, 0.0, 0.0, 0.0]]), [sampler]) == [2]  # 2 / 2 < 1.5
    plain = SequenceSampler(SamplingParams(temperature=0.0))
    plain.saw([0])
    assert not plain.seen_ids  # nothing kept when the penalty is off


def test_penalties_change_greedy_choice_and_caller_logits_are_untouched() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]])  # [1, 4]
    original = logits.clone()
    sampler = SequenceSampler(SamplingParams(temperature=0.0, frequency_penalty=0.6, max_tokens=10))
    assert sample_next_tokens(logits, [sampler]) == [0]
    sampler.record(0)
    assert sample_next_tokens(logits, [sampler]) == [0]  # 5 - 0.6 > 4
    sampler.record(0)
    assert sample_next_tokens(logits, [sampler]) == [1]  # 5 - 1.2 < 4
    assert torch.equal(logits, original)


# ---------------------------------------------------------------- finish rules

def _reason(sampler: SequenceSampler, tok: int) -> FinishReason | None:
    """Why the sequence ends if `tok` is its next token: the one finish rule, over the sampler's count (as the
    scheduler and the engine apply it); the sampler itself decides no end."""
    return finish_reason(sampler.params, sampler.num_generated, tok, sampler.eos_token_ids,
                         constrained=sampler.constraint is not None)


def _record(sampler: SequenceSampler, tok: int) -> FinishReason | None:
    """`tok`'s finish reason (decided before it is recorded, as the scheduler does), then record it."""
    reason = _reason(sampler, tok)
    sampler.record(tok)
    return reason


def _eos_heavy_logits(rows: int = 1) -> torch.Tensor:
    logits = torch.zeros(rows, VOCAB)  # [rows, V]
    logits[:, EOS] = 100.0
    logits[:, 5] = 50.0
    logits[:, 6] = 10.0
    return logits


def test_min_tokens_blocks_eos_and_stop_ids_then_stops() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(5,), max_tokens=10)
    sampler = SequenceSampler(params, eos_token_ids=(EOS,))
    logits = _eos_heavy_logits()
    reasons = []
    for _ in range(4):
        tok = sample_next_tokens(logits, [sampler])[0]
        reasons.append((tok, _record(sampler, tok)))
    assert reasons == [(6, None), (6, None), (6, None), (EOS, "stop")]
    assert next(r for _, r in reasons if r is not None) == "stop"
    assert not hasattr(sampler, "finish_reason")  # the scheduler's to decide, not the sampler's


def test_min_tokens_mask_applies_to_sampled_rows_too() -> None:
    logits = _eos_heavy_logits(rows=200)
    samplers = [SequenceSampler(SamplingParams(seed=i, min_tokens=1), (EOS,)) for i in range(200)]
    assert EOS not in sample_next_tokens(logits, samplers)


def test_ignore_eos_keeps_going_until_length() -> None:
    sampler = SequenceSampler(SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=3), (EOS,))
    logits = _eos_heavy_logits()
    out = []
    for _ in range(3):
        tok = sample_next_tokens(logits, [sampler])[0]
        out.append((tok, _record(sampler, tok)))
    assert out == [(EOS, None), (EOS, None), (EOS, "length")]


def test_max_tokens_gives_length_and_stop_ids_give_stop() -> None:
    s = SequenceSampler(SamplingParams(max_tokens=2, stop_token_ids=(9,)), eos_token_ids=(EOS,))
    assert _reason(s, 4) is None
    assert _record(s, 4) is None
    assert _reason(s, 4) == "length"
    assert _reason(s, 9) == "stop"  # stop wins over length on the same token
    assert _reason(s, EOS) == "stop"
    assert _record(s, 9) == "stop"
    assert s.num_generated == 2 and s.token_counts == {4: 1, 9: 1}


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize(("kwargs", "param"), [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.1}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"presence_penalty": 2.1}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"seed": "x"}, "seed"),
    ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ({"stop": ("ok", "")}, "stop"),
])
def test_validate_names_the_bad_param(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs).validate()
    assert info.value.param == param
    assert param in str(info.value)


def test_validate_accepts_edges_and_coerces_stop() -> None:
    p = SamplingParams(temperature=2.0, top_p=1.0, top_k=-1, presence_penalty=-2.0, frequency_penalty=2.0,
                       max_tokens=1, min_tokens=1, stop=["a", "b", "c", "d", "e"], stop_token_ids=[3],
                       seed=-5)
    assert p.validate() is p
    assert p.stop == ("a", "b", "c", "d", "e") and p.stop_token_ids == (3,)
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(temperature=0).validate().is_greedy


# ---------------------------------------------------------------- stop strings

def _stream(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, bool]:
    out = []
    hit = False
    for d in deltas:
        text, hit = matcher.feed(d)
        out.append(text)
    out.append(matcher.flush())
    return "".join(out), hit


def test_stop_string_split_across_deltas_is_cut_and_not_emitted() -> None:
    m = StopStringMatcher(("STOP",))
    assert m.feed("Hello S") == ("Hello ", False)  # "S" held back
    assert m.feed("TO") == ("", False)
    assert m.feed("P and more") == ("", True)
    assert m.feed("ignored") == ("", True)
    assert m.flush() == ""
    assert m.matched == "STOP"


def test_held_back_text_is_released_when_it_cannot_be_a_stop() -> None:
    m = StopStringMatcher(("STOP",))
    assert m.feed("a ST") == ("a ", False)
    assert m.feed("OX") == ("STOX", False)
    assert m.feed("ST") == ("", False)
    assert m.flush() == "ST"


def test_overlapping_prefixes_and_multiple_stop_strings() -> None:
    assert _stream(StopStringMatcher(("aab",)), ["a", "a", "a", "b", "c"]) == ("a", True)
    # "aba" looks like the start of "abac" twice; the real match starts at the second "a".
    assert _stream(StopStringMatcher(("abac",)), ["ab", "aba", "c!"]) == ("ab", True)
    # The stop string that completes first wins, however the text is split.
    assert _stream(StopStringMatcher(("abc", "b")), ["abc"]) == ("a", True)
    assert _stream(StopStringMatcher(("abc", "b")), ["a", "bc"]) == ("a", True)
    assert _stream(StopStringMatcher(("xyz", "yz")), ["wxyz"]) == ("w", True)  # same end: earliest start
    assert _stream(StopStringMatcher(("\n\n", "END")), ["one\n", "two E", "ND\n\n"]) == ("one\ntwo ", True)
    assert _stream(StopStringMatcher(()), ["any", "thing"]) == ("anything", False)


def _reference_cut(text: str, stops: tuple[str, ...]) -> str:
    """Text before the stop string that completes first (ties: the longest), found end by end."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(len(s) for s in done)]
    return text


@given(
    text=st.text(alphabet="abc\n", max_size=40),
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=3),
    data=st.data(),
)
@settings(max_examples=300, deadline=None)
def test_stop_matcher_output_is_independent_of_chunking(
    text: str, stops: list[str], data: st.DataObject
) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    expected = _reference_cut(text, tuple(stops))
    out, hit = _stream(StopStringMatcher(tuple(stops)), deltas)
    assert out == expected
    assert hit == any(s in text for s in stops)


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(InvalidRequestError) as info:
        StopStringMatcher(("",))
    assert info.value.param == "stop"

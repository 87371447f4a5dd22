"""What clients ask of sampling, through the whole mesh (`aflex up`, the official `openai` client):
logprobs equal to the model's own, `n` choices that share one prefill, vLLM's repetition penalty.

The logprobs' reference is transformers' forward of the same tiny checkpoint over the whole sequence in float32:
log_softmax of its logits. The mesh reads them off its own passes instead (the sampled rows, and for an
echoed prompt the prefill's rows, carried across chunks of 16 tokens), and must agree on every position.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import torch

from tests.conftest import CHAT_CHUNK_TOKENS
from tools.launch import Mesh

TOL = 2e-4  # float32 over two layers, a different summation order
CHUNK_TOKENS = CHAT_CHUNK_TOKENS


@pytest.fixture(scope="module")
def mesh(chat_mesh: Mesh) -> Mesh:
    return chat_mesh


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_chat_checkpoint: Path) -> Callable[[list[int]], torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_chat_checkpoint, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        """[len(ids), V]: row p is log p(next token | ids[:p + 1])."""
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _ids(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _check_against(reference: torch.Tensor, ids: list[int], token_logprobs: list[float | None],
                   top_logprobs: list[dict[str, float] | None], top_n: int) -> None:
    """Position p (p >= 1): the token's logprob and the top `top_n` agree with reference row p - 1."""
    assert token_logprobs[0] is None and top_logprobs[0] is None
    for p in range(1, len(ids)):
        row = reference[p - 1]
        assert token_logprobs[p] == pytest.approx(row[ids[p]].item(), abs=TOL), p
        top = top_logprobs[p]
        assert top is not None
        best = row.topk(top_n)
        expected = {f"token_id:{t}": v for t, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)}
        expected.setdefault(f"token_id:{ids[p]}", row[ids[p]].item())  # vLLM: the token itself is listed too
        assert top.keys() == expected.keys(), p
        assert all(top[k] == pytest.approx(v, abs=TOL) for k, v in expected.items()), p


def test_echo_gives_the_prompt_and_output_logprobs_of_the_model(client: openai.OpenAI, reference: Any) -> None:
    prompt = random.Random(7).sample(range(300, 40000), 40)  # token ids: three prefill chunks
    r = client.completions.create(model=_model(client), prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                  logprobs=3, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    choice = r.choices[0]
    assert choice.logprobs is not None and r.usage is not None and r.usage.completion_tokens == 5
    ids = _ids(choice.logprobs.tokens or [])
    assert ids[:40] == prompt and len(ids) == 45
    ref = reference(ids)
    _check_against(ref, ids, choice.logprobs.token_logprobs or [], choice.logprobs.top_logprobs or [], 3)
    assert ids[40:] == ref[39:44].argmax(dim=-1).tolist()  # greedy: each output token is the model's best
    offsets = choice.logprobs.text_offset or []
    assert offsets == [sum(len(t) for t in (choice.logprobs.tokens or [])[:i]) for i in range(45)]


def test_echo_with_one_token_as_lm_eval_asks(client: openai.OpenAI, reference: Any) -> None:
    """lm-evaluation-harness's loglikelihood request: context + continuation, echo, logprobs 1, max_tokens 1.
    It sums token_logprobs[ctxlen:-1] and calls the continuation greedy when each is its row's best."""
    context, continuation = [1, 5210, 314, 260, 3587], [28, 2362, 30]
    r = client.completions.create(model=_model(client), prompt=context + continuation, max_tokens=1,
                                  temperature=0, echo=True, logprobs=1,
                                  extra_body={"return_tokens_as_token_ids": True})
    logprobs = r.choices[0].logprobs
    assert logprobs is not None
    token_logprobs = logprobs.token_logprobs or []
    top = logprobs.top_logprobs or []
    assert len(token_logprobs) == len(context) + len(continuation) + 1
    ref = reference(context + continuation)
    expected = sum(ref[p - 1, t].item() for p, t in enumerate(continuation, start=len(context)))
    assert sum(token_logprobs[len(context):-1]) == pytest.approx(expected, abs=3 * TOL)  # type: ignore[arg-type]
    greedy = all(ref[p - 1].argmax().item() == t for p, t in enumerate(continuation, start=len(context)))
    assert greedy == all(lp == max(t.values()) for lp, t in zip(token_logprobs[len(context):-1],
                                                                 top[len(context):-1], strict=True) if t)


def test_streamed_echo_equals_the_whole_response(client: openai.OpenAI) -> None:
    body: dict[str, Any] = {"model": _model(client), "prompt": "The sea is", "max_tokens": 6, "temperature": 0,
                            "echo": True, "logprobs": 2, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**body).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**body, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text and whole.text.startswith("The sea is")
    assert chunks[0].text.startswith("The sea is")  # the prompt comes with the first chunk
    streamed = [t for c in chunks if c.logprobs is not None for t in (c.logprobs.token_logprobs or [])]
    assert whole.logprobs is not None and streamed == whole.logprobs.token_logprobs
    assert streamed[0] is None and all(lp is not None for lp in streamed[1:])


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_and_top_logprobs(client: openai.OpenAI, stream: bool) -> None:
    kwargs: dict[str, Any] = {"model": _model(client), "messages": [{"role": "user", "content": "Hi there"}],
                              "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3,
                              "extra_body": {"ignore_eos": True}}
    plain = client.chat.completions.create(**{**kwargs, "logprobs": None, "top_logprobs": None}).choices[0]
    assert plain.logprobs is None
    if stream:
        chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
        text = "".join(c.delta.content or "" for c in chunks)
        content = [e for c in chunks if c.logprobs is not None for e in (c.logprobs.content or [])]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        text, content = choice.message.content or "", (choice.logprobs.content or []) if choice.logprobs else []
    assert text == plain.message.content  # asking for logprobs changes nothing else
    assert len(content) == 8
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and entry.logprob == values[0]  # greedy: the best token
        assert entry.token == entry.top_logprobs[0].token and entry.bytes == list(entry.token.encode())


def test_sampled_logprobs_leave_the_seeded_tokens_alone(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": _model(client), "messages": [{"role": "user", "content": "Hi there"}],
                              "max_tokens": 10, "temperature": 1.0, "seed": 11, "extra_body": {"ignore_eos": True}}
    plain = client.chat.completions.create(**kwargs).choices[0]
    choice = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=20).choices[0]
    assert choice.message.content == plain.message.content
    assert choice.logprobs is not None and len(choice.logprobs.content or []) == 10
    for entry in choice.logprobs.content or []:
        assert entry.logprob <= entry.top_logprobs[0].logprob and len(entry.top_logprobs) == 20


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (0.9, 5)])
def test_repetition_penalty_gives_the_engine_tokens(client: openai.OpenAI, tiny_chat_checkpoint: Path,
                                                    temperature: float, seed: int | None) -> None:
    """vLLM's `repetition_penalty` over prompt and output: the mesh's tokens are the in-process engine's;
    greedy, the penalty changes them (without it the tiny model repeats a token on this prompt)."""
    from shared.engine import Engine
    from shared.model.checkpoint import open_checkpoint
    from shared.model.params import SamplingParams

    prompt = [400, 401, 402, 403] * 8  # two prefill chunks: the penalty sees both
    engine = Engine.from_checkpoint(open_checkpoint(str(tiny_chat_checkpoint)), num_kv_blocks=64, block_size=16)
    penalised = SamplingParams(temperature=temperature, seed=seed, max_tokens=16, ignore_eos=True,
                               repetition_penalty=1.8)
    expected = engine.generate([prompt], penalised)[0].token_ids
    unpenalised = engine.generate([prompt], SamplingParams(temperature=temperature, seed=seed, max_tokens=16,
                                                           ignore_eos=True))[0].token_ids
    if temperature == 0.0:
        assert expected != unpenalised and len(set(unpenalised)) < len(unpenalised)
        assert len(set(expected)) == len(expected)
    r = client.completions.create(model=_model(client), prompt=prompt, max_tokens=16, temperature=temperature,
                                  seed=seed, logprobs=0, extra_body={"ignore_eos": True, "repetition_penalty": 1.8,
                                                                     "return_tokens_as_token_ids": True})
    assert r.choices[0].logprobs is not None and _ids(r.choices[0].logprobs.tokens or []) == expected


def _n_choices(client: openai.OpenAI, prompt: list[int], n: int, seed: int) -> list[list[int]]:
    r = client.completions.create(model=_model(client), prompt=prompt, max_tokens=12, temperature=1.0, seed=seed,
                                  n=n, logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert [c.index for c in r.choices] == list(range(n))
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 12 * n)
    return [_ids(c.logprobs.tokens or []) if c.logprobs else [] for c in r.choices]


def test_n_choices_share_one_prefill_and_each_is_its_own_seeded_request(client: openai.OpenAI, mesh: Mesh) -> None:
    """n=3: choices 1 and 2 fork choice 0's prompt KV (a 40-token prompt: its last block is shared, partly
    filled, so both sides copy it on write), and each choice's tokens are those of a lone request with
    seed + index; the seeded run reproduces."""
    prompt = random.Random(11).sample(range(300, 40000), 40)
    before = mesh.output().count("shares the prompt KV of")
    choices = _n_choices(client, prompt, 3, seed=21)
    assert mesh.output().count("shares the prompt KV of") - before == 2
    assert len({tuple(c) for c in choices}) == 3
    assert choices == [_n_choices(client, prompt, 1, seed=21 + i)[0] for i in range(3)]
    assert _n_choices(client, prompt, 3, seed=21) == choices


def test_streamed_n_choices_equal_the_whole_response(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": _model(client), "messages": [{"role": "user", "content": "Tell a story"}],
                              "max_tokens": 10, "temperature": 0.9, "seed": 4, "n": 2,
                              "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**kwargs)
    texts, reasons, roles = ["", ""], [None, None], [0, 0]
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            roles[choice.index] += choice.delta.role == "assistant"
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == 20
    assert texts == [c.message.content for c in whole.choices] and texts[0] != texts[1]
    assert reasons == ["length", "length"] and roles == [1, 1]


SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3},
}, "required": ["answer", "count", "tags"], "additionalProperties": False}


def test_json_schema_output_validates_over_20_seeded_samples(client: openai.OpenAI) -> None:
    """The random tiny model writes nothing like JSON on its own; masked by the schema's grammar on the
    attention worker, every sample parses and validates, and a seed reproduces its sample."""
    form: Any = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}}
    messages: Any = [{"role": "user", "content": "Answer in JSON."}]
    plain = client.chat.completions.create(model=_model(client), messages=messages, max_tokens=60, seed=0,
                                           temperature=1.0).choices[0].message.content or ""
    with pytest.raises(ValueError):
        json.loads(plain)
    outputs = []
    for seed in range(20):
        choice = client.chat.completions.create(model=_model(client), messages=messages, max_tokens=200, seed=seed,
                                                temperature=1.0, response_format=form).choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        value = json.loads(choice.message.content or "")
        jsonschema.validate(value, SCHEMA)
        outputs.append(value)
    assert len({json.dumps(v, sort_keys=True) for v in outputs}) > 1  # sampled, not one forced answer
    again = client.chat.completions.create(model=_model(client), messages=messages, max_tokens=200, seed=3,
                                           temperature=1.0, response_format=form).choices[0].message.content
    assert json.loads(again or "") == outputs[3]


def test_json_schema_streamed_and_json_object_on_completions(client: openai.OpenAI) -> None:
    form: Any = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
    chunks = client.chat.completions.create(model=_model(client), messages=[{"role": "user", "content": "JSON"}],
                                            max_tokens=200, seed=1, temperature=0.7, stream=True, response_format=form)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    # any object: its strings are unbounded, and a random model rarely closes one, so check the start
    completion = client.completions.create(model=_model(client), prompt="x", max_tokens=8, seed=2,
                                           extra_body={"response_format": {"type": "json_object"}})
    assert completion.choices[0].text.startswith("{")


@pytest.mark.parametrize("form", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "xml"},
])
def test_a_bad_response_format_is_a_400(client: openai.OpenAI, form: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=_model(client), messages=[{"role": "user", "content": "x"}],
                                       response_format=form)
    assert info.value.body["param"] == "response_format"  # type: ignore[index]


def test_n_choices_when_choice_0_ends_with_its_first_token(client: openai.OpenAI, mesh: Mesh) -> None:
    """max_tokens 1: choice 0 is done (its KV released) in the pass the others fork from; the worker frees
    it only after they have forked, and each choice's token is that of a lone request with its seed."""
    prompt = random.Random(5).sample(range(300, 40000), 37)
    before = mesh.output().count("shares the prompt KV of")
    r = client.completions.create(model=_model(client), prompt=prompt, max_tokens=1, temperature=1.0, seed=8, n=4,
                                  logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    got = [_ids(c.logprobs.tokens or []) if c.logprobs else [] for c in r.choices]
    assert mesh.output().count("shares the prompt KV of") - before == 3
    alone = [client.completions.create(model=_model(client), prompt=prompt, max_tokens=1, temperature=1.0,
                                       seed=8 + i, logprobs=0, extra_body={"ignore_eos": True,
                                                                           "return_tokens_as_token_ids": True})
             for i in range(4)]
    assert got == [_ids(a.choices[0].logprobs.tokens or []) if a.choices[0].logprobs else [] for a in alone]
    assert "(fork_parent_missing)" not in mesh.output()  # no fork found choice 0 freed already

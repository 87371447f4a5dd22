"""Structured outputs, measured: what the grammar mask costs per token.

    python benchmarks/structured_outputs.py --json out/structured.json

1. The sampler alone, in process, on SmolLM2's vocabulary (49,152): one step of `sample_next_tokens`
   for a batch of `--batch` rows, with and without a JSON-schema `Constraint` on every row (the mask
   from llguidance, its unpacking and the -inf fill), advanced token by token.
2. The mesh (`aflex up`, the default SmolLM2-135M, one attention and one FFN worker): `--streams`
   concurrent chat streams of `--max-tokens` sampled tokens, with and without `response_format`
   (a schema whose strings are bounded, so the outputs end), side by side in one run: the time per
   output token of each stream (vLLM's TPOT), and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import openai
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.model import structured
from shared.model.checkpoint import open_model_card
from shared.model.sampling import SamplingParams, SequenceSampler, sample_next_tokens
from tools.launch import aflex_up

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "genres": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "summary": {"type": "string", "maxLength": 200},
}, "required": ["title", "year", "genres", "summary"], "additionalProperties": False}


def sampler_step_ms(batch: int, steps: int) -> dict[str, float]:
    """Mean ms of one sampling step for `batch` rows, unconstrained and constrained."""
    card = open_model_card("default")
    assert card.tokenizer is not None
    vocab = card.args.vocab_size
    grammar = structured.grammar_for("json_schema", SCHEMA)
    assert grammar is not None
    llg = structured.llg_tokenizer(card.tokenizer, vocab)
    noise = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    for name in ("plain", "constrained"):
        samplers = [SequenceSampler(SamplingParams(temperature=1.0, seed=i, max_tokens=10**6, ignore_eos=True),
                                    card.tokenizer.eos_token_ids,
                                    structured.Constraint(llg, grammar) if name == "constrained" else None)
                    for i in range(batch)]
        spent = 0.0
        for _ in range(steps):
            logits = torch.randn(batch, vocab, generator=noise) * 4  # [B, V]
            t = time.perf_counter()
            tokens = sample_next_tokens(logits, samplers)
            for sampler, token in zip(samplers, tokens, strict=True):
                sampler.record(token)
            spent += time.perf_counter() - t
            for i, sampler in enumerate(samplers):  # an ended object starts over (not timed)
                if sampler.constraint is not None and token_done(sampler, tokens[i], card.tokenizer.eos_token_ids):
                    samplers[i] = SequenceSampler(sampler.params, card.tokenizer.eos_token_ids,
                                                  structured.Constraint(llg, grammar))
        out[f"{name}_step_ms"] = round(spent / steps * 1e3, 4)
    out["mask_ms_per_token"] = round((out["constrained_step_ms"] - out["plain_step_ms"]) / batch, 4)
    return out


def token_done(sampler: SequenceSampler, token: int, eos: tuple[int, ...]) -> bool:
    return token in eos or bool(sampler.constraint and sampler.constraint.failed)


async def tpot_s(base_url: str, streams: int, max_tokens: int, form: dict[str, Any] | None) -> list[float]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id

    async def one(i: int) -> float | None:
        extra: dict[str, Any] = {} if form is None else {"response_format": form}
        stamps: list[float] = []
        response = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Describe film number {i} as JSON."}],
            max_tokens=max_tokens, temperature=0.8, seed=i, stream=True, extra_body={"ignore_eos": form is None},
            **extra)
        async for chunk in response:
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.monotonic())
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 2 else None

    results = await asyncio.gather(*(one(i) for i in range(streams)))
    await client.close()
    return [r for r in results if r is not None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--model", default="default")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report: dict[str, Any] = {"sampler": {"batch": args.batch, "steps": args.steps,
                                          **sampler_step_ms(args.batch, args.steps)}}
    form = {"type": "json_schema", "json_schema": {"name": "film", "schema": SCHEMA}}
    with aflex_up(args.model) as mesh:
        asyncio.run(tpot_s(mesh.base_url, 2, 8, None))  # warm-up
        plain = asyncio.run(tpot_s(mesh.base_url, args.streams, args.max_tokens, None))
        constrained = asyncio.run(tpot_s(mesh.base_url, args.streams, args.max_tokens, form))
    report["mesh"] = {"streams": args.streams, "max_tokens": args.max_tokens,
                      "plain_tpot_ms_p50": round(statistics.median(plain) * 1e3, 2),
                      "constrained_tpot_ms_p50": round(statistics.median(constrained) * 1e3, 2)}
    report["mesh"]["ratio"] = round(report["mesh"]["constrained_tpot_ms_p50"] / report["mesh"]["plain_tpot_ms_p50"], 3)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode tokens/s of the in-process engine vs `transformers`' `generate`, same model, same machine.

Both run SmolLM2-135M-Instruct (the default GGUF, dequantised to float32 by each side's GGUF
loader) with the same prompt, greedy, a fixed number of new tokens (EOS ignored), at each
concurrency. Decode throughput = (sequences x decoded tokens) / decode time, where decode time is
the whole generation minus the time of a prefill-only run (one new token) of the same batch.
Ratios are measured in one run, back to back, because the machine is noisy. Each dtype in
`--dtypes` compares the two at that same dtype (float32 is exact against the reference;
bfloat16 halves the bytes each decode step reads).

    python benchmarks/engine_decode.py [--concurrency 1,16] [--new-tokens 64] [--dtypes float32,bfloat16]
                                       [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from shared.model.checkpoint import default_model_path, open_checkpoint
from shared.model.engine import Engine
from shared.model.sampling import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def time_engine(engine: Engine, prompt_ids: list[int], batch: int, new_tokens: int) -> float:
    """Seconds the engine takes to generate `new_tokens` (EOS ignored) for `batch` copies of the prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    completions = engine.generate([prompt_ids] * batch, params)
    elapsed = time.perf_counter() - start
    assert all(len(c.token_ids) == new_tokens for c in completions)
    return elapsed


def _time_hf(model: torch.nn.Module, prompt_ids: list[int], batch: int, new_tokens: int) -> float:
    inputs = torch.tensor([prompt_ids] * batch)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    assert out.shape == (batch, len(prompt_ids) + new_tokens)
    return elapsed


def decode_tokens_per_s(time_fn, model, prompt_ids: list[int], batch: int, new_tokens: int,  # type: ignore[no-untyped-def]
                        repeats: int) -> float:
    time_fn(model, prompt_ids, batch, 2)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        full = time_fn(model, prompt_ids, batch, new_tokens)
        prefill = time_fn(model, prompt_ids, batch, 1)
        best = min(best, full - prefill)
    return batch * (new_tokens - 1) / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    checkpoint = open_checkpoint("default")
    tokenizer = checkpoint.tokenizer
    assert tokenizer is not None
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))
    gguf = default_model_path()
    results = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype).eval()
        hf.generation_config.eos_token_id = None
        for batch in (int(c) for c in args.concurrency.split(",")):
            engine = Engine.from_checkpoint(checkpoint, dtype=dtype, num_kv_blocks=max(256, batch * 16),
                                            block_size=16)
            ours = decode_tokens_per_s(time_engine, engine, prompt_ids, batch, args.new_tokens, args.repeats)
            theirs = decode_tokens_per_s(_time_hf, hf, prompt_ids, batch, args.new_tokens, args.repeats)
            row = {"dtype": dtype_name, "concurrency": batch, "aflex_decode_tok_s": round(ours, 1),
                   "transformers_decode_tok_s": round(theirs, 1), "ratio": round(ours / theirs, 2)}
            results.append(row)
            print(f"{dtype_name:9s} concurrency {batch:3d}: aflex {ours:8.1f} tok/s   "
                  f"transformers {theirs:8.1f} tok/s   ratio {ours / theirs:5.2f}x", flush=True)
    report = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantised to float32)",
        "prompt_tokens": len(prompt_ids),
        "new_tokens": args.new_tokens,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "results": results,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

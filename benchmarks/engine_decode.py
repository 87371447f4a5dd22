"""Decode tokens/s of the in-process engine vs `transformers`' `generate`, same model, same machine.

Both run SmolLM2-135M-Instruct (the default GGUF, dequantised to float32 by each side's GGUF
loader) with the same prompt, greedy, a fixed number of new tokens (EOS ignored), at each
concurrency. Decode throughput = (sequences x decoded tokens) / decode time, where decode time is
the whole generation minus the time of a prefill-only run (one new token) of the same batch.
Ratios are measured in one run, back to back, because the machine is noisy.

    python benchmarks/engine_decode.py [--concurrency 1,16] [--new-tokens 64] [--modes float32,bfloat16,int8]
                                       [--json out.json]

Modes: `float32` and `bfloat16` compare the two at that same dtype (float32 is exact against the
reference; bfloat16 halves the bytes each decode step reads); `int8` runs AFlex's W8A8 mode
(`--quantize int8`, shared/model/quant.py) against `transformers` in float32 (the precision its
GGUF loader gives) and against `transformers` with PyTorch's dynamic int8 Linear, and reports its
agreement with float32 (teacher-forced top-1, perplexity) on docs/architecture.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from shared.engine import Engine
from shared.model.checkpoint import default_model_path, open_checkpoint
from shared.model.sampling import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def environment() -> dict[str, object]:
    """What a benchmark's figures depend on besides its flags: torch, its threads, the machine."""
    from shared.model.cpu_kernels import kernel_status

    return {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "cpu_kernels": kernel_status().reason or "built (shared/model/kernels)"}


def write_report(path: Path | None, report: dict[str, object]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")


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


TRACE_SLICE = Path(__file__).resolve().parents[1] / "tests" / "data" / "azure_conv_slice.csv"


def mixed_requests(text_ids: list[int], count: int, max_prompt: int, max_output: int) -> list[tuple[list[int], int]]:
    """`count` (prompt ids, output tokens) pairs with the lengths of the first requests of the Azure
    conversation trace slice (tests/data, CC-BY 4.0), clipped; prompts are windows of a fixed text."""
    rows = TRACE_SLICE.read_text().splitlines()[1:count + 1]
    requests = []
    for index, row in enumerate(rows):
        _, context, generated = row.split(",")
        n_prompt, n_out = min(int(context), max_prompt), max(1, min(int(generated), max_output))
        start = (37 * index) % max(1, len(text_ids) - n_prompt)
        requests.append((text_ids[start:start + n_prompt], n_out))
    return requests


def time_engine_mixed(engine: Engine, requests: list[tuple[list[int], int]]) -> float:
    """Seconds for the engine to serve all requests, each to its own length (continuous batching)."""
    params = [SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True) for _, n_out in requests]
    start = time.perf_counter()
    completions = engine.generate([p for p, _ in requests], params)
    elapsed = time.perf_counter() - start
    assert [len(c.token_ids) for c in completions] == [n for _, n in requests]
    return elapsed


def time_hf_mixed(model: torch.nn.Module, requests: list[tuple[list[int], int]]) -> float:
    """Seconds for `generate` to serve the requests as one left-padded batch: it runs until the longest
    output is done (a static batch cannot release a finished sequence)."""
    longest = max(len(p) for p, _ in requests)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p, _ in requests])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in requests])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max(n for _, n in requests),
                             do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == longest + max(n for _, n in requests)
    return elapsed


MODES = {
    # mode: (AFlex dtype, AFlex quantize, transformers dtype, also transformers' dynamic int8)
    "float32": ("float32", "none", "float32", False),
    "bfloat16": ("bfloat16", "none", "bfloat16", False),
    "int8": ("float32", "int8", "float32", True),
}
ACCURACY_TEXT = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def accuracy_vs_float32(checkpoint, dtype: torch.dtype, quantize: str, reference: torch.Tensor,  # type: ignore[no-untyped-def]
                        token_ids: list[int]) -> dict[str, float]:
    """Teacher-forced next-token agreement with float32, and perplexity of both, on one fixed text."""
    from shared.engine import forward_unsplit

    engine = Engine.from_checkpoint(checkpoint, dtype=dtype, quantize=quantize)
    logits = forward_unsplit(engine.attention, engine.ffn, token_ids)
    targets = torch.tensor(token_ids[1:])
    return {
        "top1_agreement": round(float((logits.argmax(-1) == reference.argmax(-1)).float().mean()), 4),
        "perplexity": round(float(torch.nn.functional.cross_entropy(logits[:-1], targets).exp()), 3),
        "perplexity_float32": round(float(torch.nn.functional.cross_entropy(reference[:-1], targets).exp()), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default="float32", help=f"comma-separated: {', '.join(MODES)}")
    parser.add_argument("--mixed", type=int, default=0, metavar="N",
                        help="also serve N requests with the Azure conv slice's prompt/output lengths "
                             "(clipped by --mixed-max-prompt/--mixed-max-output): aggregate output tok/s")
    parser.add_argument("--mixed-max-prompt", type=int, default=512)
    parser.add_argument("--mixed-max-output", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from shared.engine import forward_unsplit

    checkpoint = open_checkpoint("default")
    tokenizer = checkpoint.tokenizer
    assert tokenizer is not None
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))
    gguf = default_model_path()
    text_ids = tokenizer.encode(ACCURACY_TEXT.read_text())[:1024]
    exact = Engine.from_checkpoint(checkpoint)
    reference = forward_unsplit(exact.attention, exact.ffn, text_ids)
    del exact
    results, accuracy = [], {}
    for mode in args.modes.split(","):
        ours_dtype, quantize, hf_dtype, hf_int8 = MODES[mode]
        if mode != "float32":
            accuracy[mode] = accuracy_vs_float32(checkpoint, getattr(torch, ours_dtype), quantize, reference, text_ids)
            print(f"{mode}: accuracy vs float32 on {ACCURACY_TEXT.name} ({len(text_ids)} tokens): {accuracy[mode]}",
                  flush=True)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=getattr(torch, hf_dtype)).eval()
        hf.generation_config.eos_token_id = None
        hf_q = None
        if hf_int8:  # transformers' model with PyTorch's own dynamic int8 Linear (fbgemm, per-tensor)
            hf_q = torch.ao.quantization.quantize_dynamic(hf, {torch.nn.Linear}, dtype=torch.qint8)
            hf_q.generation_config.eos_token_id = None
        for batch in (int(c) for c in args.concurrency.split(",")):
            engine = Engine.from_checkpoint(checkpoint, dtype=getattr(torch, ours_dtype), quantize=quantize,
                                            num_kv_blocks=max(256, batch * 16), block_size=16)
            ours = decode_tokens_per_s(time_engine, engine, prompt_ids, batch, args.new_tokens, args.repeats)
            theirs = decode_tokens_per_s(_time_hf, hf, prompt_ids, batch, args.new_tokens, args.repeats)
            row = {"mode": mode, "aflex": f"{ours_dtype}" + (f" {quantize}" if quantize != "none" else ""),
                   "transformers": hf_dtype, "concurrency": batch, "aflex_decode_tok_s": round(ours, 1),
                   "transformers_decode_tok_s": round(theirs, 1), "ratio": round(ours / theirs, 2)}
            line = (f"{mode:9s} concurrency {batch:3d}: aflex {ours:8.1f} tok/s   transformers ({hf_dtype}) "
                    f"{theirs:8.1f} tok/s   ratio {ours / theirs:5.2f}x")
            if hf_q is not None:
                theirs_q = decode_tokens_per_s(_time_hf, hf_q, prompt_ids, batch, args.new_tokens, args.repeats)
                row |= {"transformers_dynamic_int8_tok_s": round(theirs_q, 1),
                        "ratio_to_dynamic_int8": round(ours / theirs_q, 2)}
                line += f"   transformers (dynamic int8) {theirs_q:8.1f} tok/s   ratio {ours / theirs_q:5.2f}x"
            results.append(row)
            print(line, flush=True)
            del engine
        if args.mixed:
            requests = mixed_requests(text_ids, args.mixed, args.mixed_max_prompt, args.mixed_max_output)
            engine = Engine.from_checkpoint(checkpoint, dtype=getattr(torch, ours_dtype), quantize=quantize,
                                            num_kv_blocks=2048, block_size=16)
            time_engine_mixed(engine, requests[:2])  # warm-up
            outputs = sum(n for _, n in requests)
            ours = outputs / min(time_engine_mixed(engine, requests) for _ in range(args.repeats))
            hf_models = [("transformers", hf)] + ([("transformers dynamic int8", hf_q)] if hf_q is not None else [])
            line = f"{mode:9s} mixed {len(requests)} requests ({outputs} output tokens): aflex {ours:8.1f} tok/s"
            row = {"mode": mode, "workload": "mixed", "requests": len(requests), "output_tokens": outputs,
                   "prompt_tokens": sum(len(p) for p, _ in requests), "aflex_tok_s": round(ours, 1)}
            for name, model in hf_models:
                theirs = outputs / min(time_hf_mixed(model, requests) for _ in range(args.repeats))
                key = name.replace(" ", "_")
                row |= {f"{key}_tok_s": round(theirs, 1), f"ratio_to_{key}": round(ours / theirs, 2)}
                line += f"   {name} {theirs:8.1f} tok/s   ratio {ours / theirs:5.2f}x"
            results.append(row)
            print(line, flush=True)
            del engine
    report = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised by each side's loader)",
        "prompt_tokens": len(prompt_ids),
        "new_tokens": args.new_tokens,
        **environment(),
        "results": results,
        "accuracy_vs_float32": accuracy,
    }
    write_report(args.json, report)


if __name__ == "__main__":
    main()

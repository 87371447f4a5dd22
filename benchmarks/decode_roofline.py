"""The roofline of one decode step of the in-process engine (`aflex generate`), and each part beside it.

    python benchmarks/decode_roofline.py [--model default] [--rows 16] [--context 160] [--steps 20]
                                         [--json out/decode_roofline.json]

The machine's two rates, measured here with the engine's torch threads: memory bandwidth (a 1 GiB float32
copy: bytes read + written per second) and the float32 matrix-product rate (a 2048-cube `mm`). The model's
decode step at `rows` sequences of `context` tokens: the bytes of every weight it streams (each layer's
attention and FFN products, the LM head) and the FLOPs of its products (2 x rows x weights) and attention
(4 x rows x context x q-heads x head_dim a layer). A part's bound is the larger of bytes / bandwidth and FLOPs
/ rate; its measured time is timed on the engine's own modules over `steps` decode steps of the same batch,
part by part (`torch` ops only: what Python adds is the whole step less the parts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shared.engine import Engine
from shared.model.attention import AttentionMeta, SequencePass
from shared.model.checkpoint import open_checkpoint
from shared.model.sampling import SamplingParams, SequenceSampler, sample_next_tokens
from shared.model.split_point import add_rms_norm


def machine_rates(threads: int) -> dict[str, float]:
    """Bandwidth (GB/s, a copy's read + write) and float32 product rate (GFLOP/s), best of 5 each."""
    torch.set_num_threads(threads)
    src, dst = torch.ones(2**28), torch.empty(2**28)  # 1 GiB each
    copy_s = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    mm_s = min(_timed(lambda: torch.mm(a, b)) for _ in range(5))
    return {"bandwidth_gbs": round(2 * src.numel() * 4 / copy_s / 1e9, 2),
            "matmul_gflops": round(2 * 2048**3 / mm_s / 1e9, 1)}


def _timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def decode_batch(engine: Engine, rows: int, context: int) -> None:
    """`rows` sequences prefilled to `context` tokens, each with its next token waiting to be decoded."""
    params = SamplingParams(temperature=0.0, max_tokens=1024, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"s{i}", [100 + (i * 7 + k) % 40_000 for k in range(context)], params)
    while any(seq.num_computed < seq.num_tokens - 1 for seq in engine.running) or engine.waiting:
        engine.step()


def timed_parts(engine: Engine, steps: int) -> dict[str, float]:
    """Median milliseconds per decode step of each part, timed on the engine's modules (the KV written by
    these passes is the engine's own: each pass re-decodes the same positions)."""
    attention, ffn, kv = engine.attention, engine.ffn, engine.kv
    seqs = list(engine.running)
    for seq in seqs:  # the slot of the token each pass decodes (the engine reserves it as it schedules)
        engine.block_tables.reserve(seq.seq_id, seq.num_computed + 1)
    parts: dict[str, list[float]] = {k: [] for k in ("setup", "norms", "qkv_rope", "attention", "o_proj", "ffn",
                                                      "lm_head", "sample_t1", "sample_greedy", "step")}
    samplers_t1 = [_sampler(1.0) for _ in seqs]
    samplers_greedy = [_sampler(0.0) for _ in seqs]
    with torch.inference_mode():
        for _ in range(steps):
            t = time.perf_counter()
            passes = [SequencePass(s.num_computed, 1, engine.block_tables.slots(s.seq_id, 0, s.num_computed + 1),
                                   wants_logits=True) for s in seqs]
            meta = AttentionMeta.build(passes, engine.device)
            tokens = torch.tensor([s.all_ids[s.num_computed] for s in seqs])
            rope = attention.rope(meta.positions)
            residual = attention.embed(tokens)
            parts["setup"].append(time.perf_counter() - t)
            spent = dict.fromkeys(("norms", "qkv_rope", "attention", "o_proj", "ffn"), 0.0)
            ffn_out = None
            for layer in range(engine.args.n_layers):
                block = attention.block(layer)
                t = time.perf_counter()
                if ffn_out is None:
                    x = block.input_layernorm(residual)
                else:
                    residual, x = add_rms_norm(residual, ffn_out, block.input_layernorm)
                spent["norms"] += time.perf_counter() - t
                attn = block.self_attn
                t = time.perf_counter()
                attn_out = attn(x, rope[0], rope[1], meta, kv.k[layer], kv.v[layer])
                whole_s = time.perf_counter() - t
                t = time.perf_counter()  # the block's products again, alone: its attention is the rest
                attn.project_qkv(x, rope[0], rope[1])
                qkv_s = time.perf_counter() - t
                t = time.perf_counter()
                attn.o_proj(attn_out)
                o_s = time.perf_counter() - t
                spent["qkv_rope"] += qkv_s
                spent["o_proj"] += o_s
                spent["attention"] += whole_s - qkv_s - o_s
                t = time.perf_counter()
                residual, ffn_in = add_rms_norm(residual, attn_out, block.post_attention_layernorm)
                spent["norms"] += time.perf_counter() - t
                t = time.perf_counter()
                ffn_out = ffn(layer, ffn_in)
                spent["ffn"] += time.perf_counter() - t
            for name, seconds in spent.items():
                parts[name].append(seconds)
            assert ffn_out is not None
            t = time.perf_counter()
            logits = attention.logits(residual, ffn_out, meta.logits_rows)
            parts["lm_head"].append(time.perf_counter() - t)
            for name, samplers in (("sample_t1", samplers_t1), ("sample_greedy", samplers_greedy)):
                t = time.perf_counter()
                sample_next_tokens(logits, samplers)
                parts[name].append(time.perf_counter() - t)
        for _ in range(steps):  # the engine's own step, Python included (each decodes one more token a row)
            parts["step"].append(_timed(engine.step))
    return {name: round(1e3 * statistics.median(values), 3) for name, values in parts.items()}


def _sampler(temperature: float) -> SequenceSampler:
    return SequenceSampler(SamplingParams(temperature=temperature, seed=0))


def model_costs(engine: Engine, rows: int, context: int) -> dict[str, dict[str, float]]:
    """Bytes streamed and FLOPs of each part of one decode step."""
    args = engine.args
    block = engine.attention.block(0)
    attn = block.self_attn
    size = 4  # float32
    qkv = sum(m.weight.numel() for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    o = attn.o_proj.weight.numel()
    ffn = sum(p.numel() for p in engine.ffn.layers[0].parameters())
    head = engine.attention.embed_tokens.weight.numel()
    layers = args.n_layers
    heads_dim = args.n_heads * args.head_dim
    kv_bytes = 2 * rows * context * args.n_kv_heads * args.head_dim * size
    return {
        "qkv_rope": {"bytes": layers * qkv * size, "flops": layers * 2 * rows * qkv},
        "attention": {"bytes": layers * kv_bytes, "flops": layers * 4 * rows * context * heads_dim},
        "o_proj": {"bytes": layers * o * size, "flops": layers * 2 * rows * o},
        "ffn": {"bytes": layers * ffn * size, "flops": layers * 2 * rows * ffn},
        "lm_head": {"bytes": head * size, "flops": 2 * rows * head},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path, default=Path("out/decode_roofline.json"))
    args = parser.parse_args()
    threads = torch.get_num_threads()
    rates = machine_rates(threads)
    engine = Engine.from_checkpoint(open_checkpoint(args.model), num_kv_blocks=max(256, args.rows * 16),
                                    block_size=16)
    decode_batch(engine, args.rows, args.context)
    measured = timed_parts(engine, args.steps)
    costs = model_costs(engine, args.rows, args.context)
    table: list[dict[str, Any]] = []
    for part, ms in measured.items():
        cost = costs.get(part)
        bound_ms = None if cost is None else 1e3 * max(cost["bytes"] / (rates["bandwidth_gbs"] * 1e9),
                                                         cost["flops"] / (rates["matmul_gflops"] * 1e9))
        table.append({"part": part, "measured_ms": ms, **(cost or {}),
                      "bound_ms": None if bound_ms is None else round(bound_ms, 3),
                      "measured_over_bound": None if not bound_ms else round(ms / bound_ms, 2)})
    total_bound = sum(r["bound_ms"] or 0.0 for r in table)
    doc = {"threads": threads, "rows": args.rows, "context": args.context, **rates, "parts": table,
           "bound_step_ms": round(total_bound, 2), "step_ms": measured["step"],
           "parts_sum_ms": round(sum(ms for p, ms in measured.items() if p not in ("step", "sample_greedy")), 2)}
    print(f"{threads} threads: {rates['bandwidth_gbs']} GB/s, {rates['matmul_gflops']} GFLOP/s float32")
    print(f"{'part':<14}{'measured ms':>12}{'bound ms':>10}{'x bound':>9}{'MB':>9}{'GFLOP':>8}")
    for r in table:
        print(f"{r['part']:<14}{r['measured_ms']:>12.3f}{(r['bound_ms'] or 0):>10.3f}"
              f"{(r['measured_over_bound'] or 0):>9.2f}{r.get('bytes', 0) / 1e6:>9.1f}{r.get('flops', 0) / 1e9:>8.2f}")
    print(f"step {doc['step_ms']} ms; parts (sampling at temperature 1) {doc['parts_sum_ms']} ms; "
          f"roofline {doc['bound_step_ms']} ms")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

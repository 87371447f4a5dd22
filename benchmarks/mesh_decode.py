"""Decode tokens/s of the mesh (`aflex up`, one attention + one FFN worker) vs the in-process engine,
and the per-layer attention<->FFN hop vs a bare NATS request/reply round trip.

Throughput: one `aflex up` per microbatch depth; after a warm-up request, `--concurrency` streamed
chat requests (the official `openai` AsyncOpenAI client, the same prompt, `max_tokens` fixed, EOS
ignored, greedy) start together. Mesh decode tokens/s = sum over streams of (tokens - 1) / (time
from the last stream's first token to the last stream's last token): the first token of every
stream is prefill, so the window opens when the last prefill is out and every stream is decoding.
The engine (`shared.model.engine.Engine`, both halves in this process) decodes the same prompt ids
(the chat template rendered with the checkpoint's tokenizer, as the gateway does), measured as
benchmarks/engine_decode.py does: whole generation minus a prefill-only run of the same batch.
Ratios are measured in one run, because the machine is noisy: with each depth's mesh up (and idle),
every round is a pair, the engine's round right before the mesh's; a depth's ratio is the median
over its rounds of mesh/engine, and the tokens/s columns are each side's best round.

Hop: during the depth-1 run every `MicrobatchDone` on `aflex.v1.sched.done` of a pure decode
microbatch (every sequence in it was seen in an earlier one: a prompt is prefilled in one pass)
with all `--concurrency` rows is kept. Hop per layer = (ffn_wait_s - ffn_compute_s) / n_layers:
the attention worker's wait for the FFN minus the FFN worker's own forward time, which the FFN
worker reports in each reply (so it is the transport and queueing, measured under the same load).
The in-process FFN time for the same rows is printed beside it for reference.
The bare round trip is a nats-py request/reply carrying the same
payload (that tensor's bytes) to an echo responder in another process, on our own nats-server.

    python benchmarks/mesh_decode.py [--model default] [--concurrency 16] [--max-tokens 48]
                                     [--depths 1,2] [--repeats 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from engine_decode import PROMPT, environment, time_engine, write_report  # the script's folder is on sys.path

from shared import subjects
from shared.messages import MicrobatchDone, decode
from shared.model.checkpoint import open_checkpoint
from shared.model.engine import Engine
from shared.model.weights import load_ffn_half
from shared.nats_server import EmbeddedNatsServer
from tools.launch import aflex_up

ROOT = Path(__file__).resolve().parent.parent

ECHO_RESPONDER = """
import asyncio, sys
import nats

async def main():
    nc = await nats.connect(sys.argv[1])
    async def echo(msg):
        await msg.respond(msg.data)
    await nc.subscribe("bench.echo", cb=echo)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await nc.close()

asyncio.run(main())
"""


# -- the mesh -------------------------------------------------------------------------------------


async def _stream(client: Any, model: str, max_tokens: int) -> dict[str, Any]:
    first = last = None
    tokens = 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens, temperature=0.0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:
            first = now if first is None else first  # the role chunk goes out with the first token
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    assert first is not None and last is not None and tokens == max_tokens, (tokens, max_tokens)
    return {"first": first, "last": last, "tokens": tokens}


async def mesh_round(port: int, concurrency: int, max_tokens: int) -> float:
    """One round of `concurrency` streams; returns decode tokens/s as the module docstring defines it."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600.0, max_retries=0)
    try:
        model = (await client.models.list()).data[0].id
        streams = await asyncio.gather(*(_stream(client, model, max_tokens) for _ in range(concurrency)))
    finally:
        await client.close()
    window = max(s["last"] for s in streams) - max(s["first"] for s in streams)
    return sum(s["tokens"] - 1 for s in streams) / window


async def mesh_decode(port: int, nats_port: int, concurrency: int, max_tokens: int, repeats: int,
                      collect: bool, engine_round: Callable[[], float]
                      ) -> tuple[list[tuple[float, float]], list[tuple[int, MicrobatchDone]]]:
    """Warm-up, then `repeats` pairs (engine round, mesh round) of decode tokens/s; with `collect`, the
    decode microbatches' MicrobatchDone (with their rows)."""
    import nats

    await mesh_round(port, 1, 4)  # warm-up
    seen: set[str] = set()
    dones: list[tuple[int, MicrobatchDone]] = []
    nc = None
    if collect:
        nc = await nats.connect(f"nats://127.0.0.1:{nats_port}")

        async def on_done(msg: Any) -> None:
            done = decode(MicrobatchDone, msg.data)
            ids = {r.seq_id for r in done.results}
            # A prompt fits one pass, so a sequence's first microbatch is its prefill: a microbatch
            # whose every sequence was seen before is pure decode (one row per sequence).
            if done.error is None and ids and ids <= seen and all(r.token_id is not None for r in done.results):
                dones.append((len(done.results), done))
            seen.update(ids)

        await nc.subscribe(subjects.SCHED_DONE, cb=on_done)
        await nc.flush()
    try:
        rates = []
        for _ in range(repeats):
            engine_tok_s = engine_round()  # blocks the loop: nothing of ours is in flight meanwhile
            rates.append((engine_tok_s, await mesh_round(port, concurrency, max_tokens)))
    finally:
        if nc is not None:
            await nc.flush()
            await nc.close()
    return rates, dones


# -- the engine -----------------------------------------------------------------------------------


def engine_round(engine: Engine, prompt_ids: list[int], batch: int, new_tokens: int) -> float:
    """Decode tokens/s of one round: the whole generation minus a prefill-only run of the same batch."""
    full = time_engine(engine, prompt_ids, batch, new_tokens)
    prefill = time_engine(engine, prompt_ids, batch, 1)
    return batch * (new_tokens - 1) / (full - prefill)


# -- the hop --------------------------------------------------------------------------------------


def ffn_layer_s(ffn: torch.nn.Module, n_layers: int, rows: int, hidden: int, rounds: int = 20) -> float:
    """Median time of one `ffn(layer, x)` on a [rows, hidden] float32 tensor, over all layers."""
    x = torch.randn(rows, hidden)
    times = []
    with torch.inference_mode():
        for layer in range(n_layers):
            ffn(layer, x)  # warm-up
        for _ in range(rounds):
            for layer in range(n_layers):
                t = time.perf_counter()
                ffn(layer, x)
                times.append(time.perf_counter() - t)
    return statistics.median(times)


async def bare_round_trip_s(payload: bytes, samples: int) -> float:
    """Median nats-py request/reply time of `payload` to an echo responder (another process)."""
    import nats

    with EmbeddedNatsServer() as server:
        responder = subprocess.Popen([sys.executable, "-c", ECHO_RESPONDER, server.url], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            assert responder.stdout is not None
            assert responder.stdout.readline().strip() == "ready"
            nc = await nats.connect(server.url)
            try:
                for _ in range(20):  # warm-up
                    await nc.request("bench.echo", payload, timeout=10)
                times = []
                for _ in range(samples):
                    t = time.perf_counter()
                    reply = await nc.request("bench.echo", payload, timeout=10)
                    times.append(time.perf_counter() - t)
                    assert len(reply.data) == len(payload)
            finally:
                await nc.close()
        finally:
            assert responder.stdin is not None
            responder.stdin.close()
            try:
                responder.wait(timeout=10)
            except subprocess.TimeoutExpired:
                responder.kill()
                responder.wait()
    return statistics.median(times)


# -- main -----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--depths", default="1,2")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hop-samples", type=int, default=500)
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch threads per worker (default: aflex up's split of the cores)")
    parser.add_argument("--quantize", choices=["none", "int8"], default="none",
                        help="both sides: the engine and the mesh's workers (int8 = W8A8, shared/model/quant.py)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    checkpoint = open_checkpoint(args.model)
    tokenizer = checkpoint.tokenizer
    assert tokenizer is not None
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                                add_generation_prompt=True))
    model_args = checkpoint.args
    n_layers, hidden = model_args.n_layers, model_args.dim

    engine = Engine.from_checkpoint(checkpoint, num_kv_blocks=max(256, args.concurrency * 16), block_size=16,
                                    quantize=args.quantize)
    throughput = []
    decode_dones: list[tuple[int, MicrobatchDone]] = []
    time_engine(engine, prompt_ids, args.concurrency, 2)  # warm-up
    for depth in (int(d) for d in args.depths.split(",")):
        with aflex_up(args.model, "--attention-workers", "1", "--ffn-workers", "1",
                      "--microbatch-depth", str(depth), "--quantize", args.quantize,
                      *(["--torch-threads", str(args.torch_threads)] if args.torch_threads else [])) as mesh:
            port, nats_port = mesh.port, mesh.nats_port
            pairs, dones = asyncio.run(mesh_decode(
                port, nats_port, args.concurrency, args.max_tokens, args.repeats, depth == 1,
                functools.partial(engine_round, engine, prompt_ids, args.concurrency, args.max_tokens)))
        if depth == 1:
            decode_dones = dones
        mesh_best, engine_best = max(m for _, m in pairs), max(e for e, _ in pairs)
        ratio = statistics.median(m / e for e, m in pairs)
        throughput.append({"depth": depth, "mesh_decode_tok_s": round(mesh_best, 1),
                           "engine_decode_tok_s": round(engine_best, 1), "ratio": round(ratio, 2),
                           "rounds": [{"engine_tok_s": round(e, 1), "mesh_tok_s": round(m, 1),
                                       "ratio": round(m / e, 2)} for e, m in pairs]})
        print(f"depth {depth}: mesh {mesh_best:8.1f} tok/s   engine {engine_best:8.1f} tok/s (best of {len(pairs)})   "
              f"ratio {ratio:5.2f}x (median of rounds "
              f"{', '.join(f'{m:.1f}/{e:.1f}' for e, m in pairs)})", flush=True)

    hop: dict[str, Any] = {}
    full = [(rows, d) for rows, d in decode_dones if rows == args.concurrency]
    if full:
        rows = args.concurrency
        ffn = load_ffn_half(model_args, checkpoint.tensors, quantize=args.quantize)
        ffn_s = ffn_layer_s(ffn, n_layers, rows, hidden)
        payload = bytes(torch.randn(rows, hidden).numpy().data)
        bare_s = asyncio.run(bare_round_trip_s(payload, args.hop_samples))
        hops = [(d.ffn_wait_s - d.ffn_compute_s) / n_layers for _, d in full]
        hop_s = statistics.median(hops)
        hop = {
            "decode_microbatches": len(full), "rows": rows, "payload_bytes": len(payload), "n_layers": n_layers,
            "mean_attention_s": round(statistics.mean(d.attention_s for _, d in full), 5),
            "mean_ffn_wait_s": round(statistics.mean(d.ffn_wait_s for _, d in full), 5),
            "mean_total_s": round(statistics.mean(d.total_s for _, d in full), 5),
            "ffn_wait_per_layer_ms": round(statistics.median(d.ffn_wait_s for _, d in full) / n_layers * 1e3, 3),
            "ffn_compute_per_layer_ms": round(statistics.median(d.ffn_compute_s for _, d in full) / n_layers * 1e3, 3),
            "ffn_compute_in_process_per_layer_ms": round(ffn_s * 1e3, 3),
            "hop_per_layer_ms": round(hop_s * 1e3, 3),
            "bare_round_trip_ms": round(bare_s * 1e3, 3),
            "ratio": round(hop_s / bare_s, 2),
        }
        print(f"decode microbatches ({len(full)} of {rows} rows): "
              f"mean attention {hop['mean_attention_s'] * 1e3:.1f} ms, "
              f"mean ffn wait {hop['mean_ffn_wait_s'] * 1e3:.1f} ms, mean total {hop['mean_total_s'] * 1e3:.1f} ms",
              flush=True)
        print(f"per layer: ffn wait {hop['ffn_wait_per_layer_ms']:.3f} ms - ffn compute "
              f"{hop['ffn_compute_per_layer_ms']:.3f} ms = hop {hop['hop_per_layer_ms']:.3f} ms;   bare NATS "
              f"round trip ({len(payload)} B) {hop['bare_round_trip_ms']:.3f} ms;   ratio {hop['ratio']:.2f}x",
              flush=True)
    else:
        print(f"no decode microbatch of {args.concurrency} rows was seen on {subjects.SCHED_DONE}", flush=True)

    report = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantised to float32)" if args.model == "default" else args.model,
        "prompt_tokens": len(prompt_ids),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "quantize": args.quantize,
        **environment(),
        "throughput": throughput,
        "hop": hop,
    }
    write_report(args.json, report)


if __name__ == "__main__":
    main()

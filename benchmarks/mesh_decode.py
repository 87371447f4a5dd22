"""Decode tokens/s of the mesh (`aflex up`) vs the in-process engine, per weight mode and microbatch
depth; the per-layer attention<->FFN hop vs bare gloo and bare NATS round trips; and the M:N meshes.

Throughput: one `aflex up` (1 attention + 1 FFN worker) per mode (float32, int8 = W8A8 in both the
engine and the workers) and depth; after a warm-up request, `--concurrency` streamed chat requests
(the official `openai` AsyncOpenAI client, the same prompt, `max_tokens` fixed, EOS ignored, greedy)
start together. Mesh decode tokens/s = sum over streams of (tokens - 1) / (time from the last
stream's first token to the last stream's last token): the first token of every stream is prefill,
so the window opens when the last prefill is out and every stream is decoding. The engine
(`shared.engine.Engine`, both halves in this process) decodes the same prompt ids, measured as
benchmarks/engine_decode.py does: whole generation minus a prefill-only run of the same batch.
Ratios are measured in one run, because the machine is noisy: with each mesh up (and idle), every
round is a pair, the engine's round right before the mesh's; a ratio is the median over its rounds
of mesh/engine, and the tokens/s columns are each side's best round.

Hop: during the float32 depth-1 run every `MicrobatchDone` on `aflex.v1.sched.done` of a pure decode
microbatch (every sequence in it was seen in an earlier one: a prompt is prefilled in one pass)
with all `--concurrency` rows is kept. Hop per layer = (ffn_wait_s - ffn_compute_s) / n_layers:
the attention worker's wait for the FFN minus the FFN worker's own forward time, which the FFN
worker reports in each reply (so it is the transport and queueing, measured under the same load).
The bare round trips carry the same payload (that tensor's bytes) between two processes on this
machine: torch.distributed gloo send/recv in a loop (`BARE_GLOO`), and nats-py request/reply to an
echo responder on our own nats-server (`ECHO_RESPONDER`); the seam round trip is the same tensor as
a seam request to a seam echo (`SEAM_ECHO`): the transport with its framing, outside the mesh.

M:N: 2 attention + 1 FFN and 1 attention + 2 FFN workers, float32, at each depth, mesh tokens/s
beside the 1+1 figure (the engine's ratio is given for reference; it has the machine to itself).

    python benchmarks/mesh_decode.py [--model default] [--modes float32,int8] [--depths 1,2]
                                     [--concurrency 16] [--max-tokens 48] [--repeats 2]
                                     [--topologies 2x1,1x2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
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
from shared.engine import Engine
from shared.messages import MicrobatchDone, decode
from shared.model.checkpoint import open_checkpoint
from shared.model.weights import load_ffn_half
from shared.transport import bus
from shared.transport.nats_server import EmbeddedNatsServer, free_port
from tools.launch import aflex_up

ROOT = Path(__file__).resolve().parent.parent

BARE_GLOO = """
import datetime, statistics, sys, time, torch
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.distributed_c10d import ProcessGroupGloo
rank, port, nbytes, samples = (int(a) for a in sys.argv[1:5])
store = TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
pg = ProcessGroupGloo(PrefixStore("bench", store), rank, 2, datetime.timedelta(seconds=60))
buffer = torch.zeros(nbytes, dtype=torch.uint8)
times = []
for i in range(samples + 50):
    t = time.perf_counter()
    if rank == 0:
        pg.send([buffer], 1, 1).wait()
        pg.recv([buffer], 1, 1).wait()
    else:
        pg.recv([buffer], 0, 1).wait()
        pg.send([buffer], 0, 1).wait()
    times.append(time.perf_counter() - t)
if rank == 0:
    print(statistics.median(times[50:]), flush=True)
"""

SEAM_ECHO = """
import asyncio, dataclasses, sys
from shared.transport import bus
from shared.transport.seam_factory import make_seam

async def main():
    nc = await bus.connect(sys.argv[1], name="bench-seam-echo")
    seam = None
    def echo(frame):
        seam.reply(frame, dataclasses.replace(frame.header, kind="to_attention"), frame.tensor)
    seam = make_seam("torch", "bench-ffn", nc, echo, lambda peer, why: None, listen=True, nats_url=sys.argv[1])
    await seam.start()
    print(seam.address, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await seam.close()
    await bus.close(nc)

asyncio.run(main())
"""

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


def bare_gloo_round_trip_s(nbytes: int, samples: int) -> float:
    """Median gloo send+recv round trip of `nbytes` between two processes (`BARE_GLOO`)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", BARE_GLOO, str(rank), str(port), str(nbytes), str(samples)],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT) for rank in (0, 1)]
    out, _ = procs[0].communicate(timeout=300)
    procs[1].wait(timeout=60)
    return float(out.strip())


async def seam_round_trip_s(rows: int, hidden: int, samples: int) -> float:
    """Median round trip of one [rows, hidden] float32 frame through the torch seam itself (request on
    the waiting thread, as a decode hop does) to a seam echo in another process: the transport with
    its framing, and no mesh around it."""
    from shared.transport.header import header_for
    from shared.transport.seam import Peer
    from shared.transport.seam_factory import make_seam

    with EmbeddedNatsServer() as server:
        echo = subprocess.Popen([sys.executable, "-c", SEAM_ECHO, server.url], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            assert echo.stdout is not None
            address = echo.stdout.readline().strip()
            nc = await bus.connect(server.url, name="bench-seam")
            seam = make_seam("torch", "bench-attn", nc, lambda frame: None, lambda peer, why: None, listen=False,
                             nats_url=server.url)
            await seam.start()
            peer = Peer("bench-ffn", address)
            await seam.connect(peer)
            x = torch.randn(rows, hidden)
            times = []
            for _ in range(samples + 50):
                t = time.perf_counter()
                await seam.request(peer, header_for("to_ffn", "bench", 0, "decode", x), x, timeout_s=30, block=True)
                times.append(time.perf_counter() - t)
            await seam.close()
            await bus.close(nc)
        finally:
            assert echo.stdin is not None
            echo.stdin.close()
            echo.wait(timeout=30)
    return statistics.median(times[50:])


async def bare_nats_round_trip_s(payload: bytes, samples: int) -> float:
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


def run_mesh(args: argparse.Namespace, engine: Engine, prompt_ids: list[int], quantize: str, depth: int,
             attention_workers: int, ffn_workers: int, collect: bool
             ) -> tuple[dict[str, Any], list[tuple[int, MicrobatchDone]]]:
    """One `aflex up` of that shape: its rounds beside the engine's, and (with `collect`) its decode Dones."""
    with aflex_up(args.model, "--attention-workers", str(attention_workers), "--ffn-workers", str(ffn_workers),
                  "--microbatch-depth", str(depth), "--quantize", quantize,
                  *(["--torch-threads", str(args.torch_threads)] if args.torch_threads else []),
                  open_nats=True) as mesh:  # it watches sched.done, which no role but the scheduler reads
        pairs, dones = asyncio.run(mesh_decode(
            mesh.port, mesh.nats_port, args.concurrency, args.max_tokens, args.repeats, collect,
            functools.partial(engine_round, engine, prompt_ids, args.concurrency, args.max_tokens)))
    mesh_best, engine_best = max(m for _, m in pairs), max(e for e, _ in pairs)
    ratio = statistics.median(m / e for e, m in pairs)
    row = {"dtype": "int8" if quantize == "int8" else "float32", "depth": depth,
           "attention_workers": attention_workers, "ffn_workers": ffn_workers,
           "mesh_tok_s": round(mesh_best, 1), "engine_tok_s": round(engine_best, 1), "ratio": round(ratio, 2),
           "rounds": [{"engine_tok_s": round(e, 1), "mesh_tok_s": round(m, 1), "ratio": round(m / e, 2)}
                      for e, m in pairs]}
    print(f"{row['dtype']:7s} {attention_workers}A+{ffn_workers}F depth {depth}: mesh {mesh_best:8.1f} tok/s   "
          f"engine {engine_best:8.1f} tok/s (best of {len(pairs)})   ratio {ratio:5.2f}x (rounds "
          f"{', '.join(f'{m:.1f}/{e:.1f}' for e, m in pairs)})", flush=True)
    return row, dones


def hop_report(args: argparse.Namespace, checkpoint: Any, decode_dones: list[tuple[int, MicrobatchDone]]
               ) -> dict[str, Any]:
    model_args = checkpoint.args
    n_layers, hidden, rows = model_args.n_layers, model_args.dim, args.concurrency
    full = [d for n, d in decode_dones if n == rows]
    if not full:
        print(f"no decode microbatch of {rows} rows was seen on {subjects.SCHED_DONE}", flush=True)
        return {}
    ffn = load_ffn_half(model_args, checkpoint.tensors)
    ffn_s = ffn_layer_s(ffn, n_layers, rows, hidden)
    payload = bytes(torch.randn(rows, hidden).numpy().data)
    gloo_s = bare_gloo_round_trip_s(len(payload), args.hop_samples)
    seam_s = asyncio.run(seam_round_trip_s(rows, hidden, args.hop_samples))
    nats_s = asyncio.run(bare_nats_round_trip_s(payload, args.hop_samples))
    hop_s = statistics.median((d.ffn_wait_s - d.ffn_compute_s) / n_layers for d in full)
    hop = {
        "payload_bytes": len(payload), "per_layer_ms": round(hop_s * 1e3, 3),
        "bare_gloo_rtt_ms": round(gloo_s * 1e3, 3), "bare_nats_rtt_ms": round(nats_s * 1e3, 3),
        "seam_rtt_ms": round(seam_s * 1e3, 3), "seam_rtt_vs_bare_gloo": round(seam_s / gloo_s, 2),
        "per_layer_vs_bare_gloo": round(hop_s / gloo_s, 2), "per_layer_vs_bare_nats": round(hop_s / nats_s, 2),
        "decode_microbatches": len(full), "rows": rows, "n_layers": n_layers,
        "mean_attention_s": round(statistics.mean(d.attention_s for d in full), 5),
        "mean_ffn_wait_s": round(statistics.mean(d.ffn_wait_s for d in full), 5),
        "mean_total_s": round(statistics.mean(d.total_s for d in full), 5),
        "ffn_wait_per_layer_ms": round(statistics.median(d.ffn_wait_s for d in full) / n_layers * 1e3, 3),
        "ffn_compute_per_layer_ms": round(statistics.median(d.ffn_compute_s for d in full) / n_layers * 1e3, 3),
        "ffn_compute_in_process_per_layer_ms": round(ffn_s * 1e3, 3),
    }
    print(f"decode microbatches ({len(full)} of {rows} rows): mean attention {hop['mean_attention_s'] * 1e3:.1f} ms, "
          f"mean ffn wait {hop['mean_ffn_wait_s'] * 1e3:.1f} ms, mean total {hop['mean_total_s'] * 1e3:.1f} ms",
          flush=True)
    print(f"per layer: ffn wait {hop['ffn_wait_per_layer_ms']:.3f} ms - ffn compute "
          f"{hop['ffn_compute_per_layer_ms']:.3f} ms = hop {hop['per_layer_ms']:.3f} ms;   bare gloo round trip "
          f"({len(payload)} B) {hop['bare_gloo_rtt_ms']:.3f} ms ({hop['per_layer_vs_bare_gloo']:.2f}x);   bare NATS "
          f"{hop['bare_nats_rtt_ms']:.3f} ms ({hop['per_layer_vs_bare_nats']:.2f}x);   the seam alone (echo) "
          f"{hop['seam_rtt_ms']:.3f} ms ({hop['seam_rtt_vs_bare_gloo']:.2f}x bare gloo)", flush=True)
    return hop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--modes", default="float32,int8", help="weight modes: float32, int8 (W8A8 on both sides)")
    parser.add_argument("--depths", default="1,2")
    parser.add_argument("--topologies", default="2x1,1x2", help="M:N meshes (attention x FFN workers) besides 1x1")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hop-samples", type=int, default=500)
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch threads per worker (default: aflex up's split of the cores)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    checkpoint = open_checkpoint(args.model)
    tokenizer = checkpoint.tokenizer
    assert tokenizer is not None
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                                add_generation_prompt=True))
    depths = [int(d) for d in args.depths.split(",")]
    throughput, topologies = [], []
    decode_dones: list[tuple[int, MicrobatchDone]] = []
    for mode in args.modes.split(","):
        quantize = {"float32": "none", "int8": "int8"}[mode]
        engine = Engine.from_checkpoint(checkpoint, num_kv_blocks=max(256, args.concurrency * 16), block_size=16,
                                        quantize=quantize)
        time_engine(engine, prompt_ids, args.concurrency, 2)  # warm-up
        for depth in depths:
            collect = mode == "float32" and depth == 1
            row, dones = run_mesh(args, engine, prompt_ids, quantize, depth, 1, 1, collect)
            throughput.append(row)
            decode_dones = dones if collect else decode_dones
        if mode == "float32" and args.topologies:
            for shape in args.topologies.split(","):
                attention_workers, ffn_workers = (int(n) for n in shape.split("x"))
                for depth in depths:
                    topologies.append(run_mesh(args, engine, prompt_ids, quantize, depth, attention_workers,
                                               ffn_workers, False)[0])
        del engine

    report = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantised to float32)" if args.model == "default" else args.model,
        "prompt_tokens": len(prompt_ids),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "seam_transport": "torch",
        **environment(),
        "hop": hop_report(args, checkpoint, decode_dones),
        "throughput": throughput,
        "topologies": topologies,
    }
    write_report(args.json, report)


if __name__ == "__main__":
    main()

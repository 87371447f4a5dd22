"""The seam hop in isolation: AFlex tensor frames vs a bare NATS request/reply, no model compute.

Separates what the wire path costs (frame encode, chunking, reassembly, the reply future, the
FFN-side queue) from what a loaded mesh adds (compute contending for the cores). Two processes on
one private nats-server, the payload a [rows, hidden] float32 tensor like a decode microbatch's
ffn_in:

- bare: nats-py `request` to an echo responder that answers inline (`msg.respond`);
- frames: the attention worker's path (`wire.encode_frames` -> `bus.publish_now` -> await a future
  keyed by (mb_id, layer)) to a responder built like the FFN worker (subscription -> queue -> serving
  loop -> `FrameAssembler` -> `encode_frames` -> `bus.publish_now` to `reply_to`), with no FFN compute.

With `--busy-ms X` both sides compute like a depth-1 mesh does: before each hop the requester runs
X ms of matrix products (the attention), and the responder X ms before each reply (the FFN), which
it reports; the round trips are given minus the responder's compute, as the live hop is. Each side
then sits idle while the other computes, with its caches cold when the message comes: what an idle
echo in a tight loop never sees. The bare path gets the same compute, so the ratio stays like for like.

    python benchmarks/hop_pingpong.py [--rows 16] [--hidden 576] [--samples 1000] [--busy-ms 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from shared import bus, wire
from shared.nats_server import EmbeddedNatsServer

BUSY = r"""
import time, torch
torch.set_num_threads(1)  # one thread per side, as `aflex up` gives each worker on two cores
_W = torch.randn(576, 3 * 1536)  # an FFN layer's weights (10.6 MB): leaves the caches as a layer does

def busy(seconds: float) -> float:
    started = time.perf_counter()
    x = torch.randn(16, 576)
    while time.perf_counter() - started < seconds:
        x @ _W
    return time.perf_counter() - started
"""

RESPONDER = BUSY + r"""
import asyncio, sys
from shared import bus, wire

async def main() -> None:
    nc = await bus.connect(sys.argv[1], "hop-responder")
    busy_s = float(sys.argv[2])
    assembler, queue = wire.FrameAssembler(), asyncio.Queue()

    async def on_frame(msg) -> None:
        queue.put_nowait(msg.data)

    async def on_echo(msg) -> None:
        if not busy_s:
            await msg.respond(msg.data)
            return
        compute_s = busy(busy_s)  # reported in the payload's first 32 bytes
        await msg.respond(compute_s.hex().encode().ljust(32) + msg.data[32:])

    await nc.subscribe("bench.hop.ffn", cb=on_frame)
    await nc.subscribe("bench.hop.echo", cb=on_echo)
    await nc.flush()
    print("ready", flush=True)
    while True:
        done = assembler.add(await queue.get())
        if done is None:
            continue
        header, tensor = done
        compute_s = busy(busy_s) if busy_s else 0.0
        reply = {"mb_id": header["mb_id"], "layer": header["layer"], "direction": "to_attention",
                 "compute_s": compute_s}
        for frame in wire.encode_frames(reply, tensor, nc.max_payload):
            await bus.publish_now(nc, header["reply_to"], frame)

asyncio.run(main())
"""


async def measure(url: str, rows: int, hidden: int, samples: int, busy_s: float) -> dict[str, float]:
    busy_ns: dict[str, Any] = {}
    exec(BUSY, busy_ns)  # the same compute as the responder's
    busy = busy_ns["busy"]
    nc = await bus.connect(url, "hop-attention")
    assembler = wire.FrameAssembler()
    waiting: dict[tuple[str, int], asyncio.Future[tuple[torch.Tensor, float]]] = {}

    async def on_reply(msg: object) -> None:
        done = assembler.add(msg.data)  # type: ignore[attr-defined]
        if done is not None:
            header, tensor = done
            waiting.pop((header["mb_id"], header["layer"])).set_result((tensor, header["compute_s"]))

    await nc.subscribe("bench.hop.attn", cb=on_reply)
    x = torch.randn(rows, hidden)
    payload = bytes(x.numpy().data)
    frame_s, bare_s = [], []
    warmup = max(20, samples // 10)
    for i in range(samples + warmup):
        future: asyncio.Future[tuple[torch.Tensor, float]] = asyncio.get_running_loop().create_future()
        waiting[("mb", i)] = future
        if busy_s:
            busy(busy_s)
        started = time.perf_counter()
        header = {"mb_id": "mb", "layer": i, "direction": "to_ffn", "reply_to": "bench.hop.attn"}
        for frame in wire.encode_frames(header, x, nc.max_payload):
            await bus.publish_now(nc, "bench.hop.ffn", frame)
        timer = asyncio.get_running_loop().call_later(10, future.cancel)  # as the worker: no wait_for
        out, compute_s = await future
        timer.cancel()
        frame_s.append(time.perf_counter() - started - compute_s)
        assert torch.equal(out, x)
        if busy_s:
            busy(busy_s)
        started = time.perf_counter()
        reply = await bus.request(nc, "bench.hop.echo", payload, timeout_s=10)
        bare_s.append(time.perf_counter() - started - (float.fromhex(reply[:32].decode()) if busy_s else 0.0))
    await bus.close(nc)
    frame_ms = statistics.median(frame_s[warmup:]) * 1e3
    bare_ms = statistics.median(bare_s[warmup:]) * 1e3
    return {"rows": rows, "hidden": hidden, "payload_bytes": len(payload), "samples": samples,
            "busy_ms": busy_s * 1e3,
            "frame_round_trip_ms": round(frame_ms, 3), "bare_round_trip_ms": round(bare_ms, 3),
            "ratio": round(frame_ms / bare_ms, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--busy-ms", type=float, default=0.0,
                        help="compute on each side per hop, like a depth-1 mesh (subtracted from the round trips)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with EmbeddedNatsServer() as server:
        responder = subprocess.Popen([sys.executable, "-c", RESPONDER, server.url, str(args.busy_ms / 1e3)],
                                     stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
        try:
            assert responder.stdout is not None and responder.stdout.readline().strip() == "ready"
            result = asyncio.run(measure(server.url, args.rows, args.hidden, args.samples, args.busy_ms / 1e3))
        finally:
            responder.kill()
            responder.wait()
    print(f"[{args.rows}, {args.hidden}] float32 ({result['payload_bytes']} B), {args.busy_ms:g} ms compute per side: "
          f"frame round trip "
          f"{result['frame_round_trip_ms']:.3f} ms, bare request/reply {result['bare_round_trip_ms']:.3f} ms, "
          f"ratio {result['ratio']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

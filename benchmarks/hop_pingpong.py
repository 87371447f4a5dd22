"""The seam hop in isolation: AFlex tensor frames vs a bare NATS request/reply, no model compute.

Separates what the wire path costs (frame encode, chunking, reassembly, the reply future, the
FFN-side queue) from what a loaded mesh adds (compute contending for the cores). Two processes on
one private nats-server, the payload a [rows, hidden] float32 tensor like a decode microbatch's
ffn_in:

- bare: nats-py `request` to an echo responder that answers inline (`msg.respond`);
- frames: the attention worker's path (`wire.encode_frames` -> publish -> await a future keyed by
  (mb_id, layer)) to a responder built like the FFN worker (subscription -> queue -> serving loop
  -> `FrameAssembler` -> `encode_frames` -> publish to `reply_to`), with no FFN compute.

    python benchmarks/hop_pingpong.py [--rows 16] [--hidden 576] [--samples 1000] [--json out.json]
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

import torch

from shared import bus, wire
from shared.nats_server import EmbeddedNatsServer

RESPONDER = r"""
import asyncio, sys
from shared import bus, wire

async def main() -> None:
    nc = await bus.connect(sys.argv[1], "hop-responder")
    assembler, queue = wire.FrameAssembler(), asyncio.Queue()

    async def on_frame(msg) -> None:
        queue.put_nowait(msg.data)

    async def on_echo(msg) -> None:
        await msg.respond(msg.data)

    await nc.subscribe("bench.hop.ffn", cb=on_frame)
    await nc.subscribe("bench.hop.echo", cb=on_echo)
    await nc.flush()
    print("ready", flush=True)
    while True:
        done = assembler.add(await queue.get())
        if done is None:
            continue
        header, tensor = done
        reply = {"mb_id": header["mb_id"], "layer": header["layer"], "direction": "to_attention"}
        for frame in wire.encode_frames(reply, tensor, nc.max_payload):
            await nc.publish(header["reply_to"], frame)

asyncio.run(main())
"""


async def measure(url: str, rows: int, hidden: int, samples: int) -> dict[str, float]:
    nc = await bus.connect(url, "hop-attention")
    assembler = wire.FrameAssembler()
    waiting: dict[tuple[str, int], asyncio.Future[torch.Tensor]] = {}

    async def on_reply(msg: object) -> None:
        done = assembler.add(msg.data)  # type: ignore[attr-defined]
        if done is not None:
            header, tensor = done
            waiting.pop((header["mb_id"], header["layer"])).set_result(tensor)

    await nc.subscribe("bench.hop.attn", cb=on_reply)
    x = torch.randn(rows, hidden)
    payload = bytes(x.numpy().data)
    frame_s, bare_s = [], []
    warmup = max(20, samples // 10)
    for i in range(samples + warmup):
        future: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        waiting[("mb", i)] = future
        started = time.perf_counter()
        header = {"mb_id": "mb", "layer": i, "direction": "to_ffn", "reply_to": "bench.hop.attn"}
        for frame in wire.encode_frames(header, x, nc.max_payload):
            await nc.publish("bench.hop.ffn", frame)
        out = await asyncio.wait_for(future, 10)
        frame_s.append(time.perf_counter() - started)
        assert torch.equal(out, x)
        started = time.perf_counter()
        await bus.request(nc, "bench.hop.echo", payload, timeout_s=10)
        bare_s.append(time.perf_counter() - started)
    await bus.close(nc)
    frame_ms = statistics.median(frame_s[warmup:]) * 1e3
    bare_ms = statistics.median(bare_s[warmup:]) * 1e3
    return {"rows": rows, "hidden": hidden, "payload_bytes": len(payload), "samples": samples,
            "frame_round_trip_ms": round(frame_ms, 3), "bare_round_trip_ms": round(bare_ms, 3),
            "ratio": round(frame_ms / bare_ms, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with EmbeddedNatsServer() as server:
        responder = subprocess.Popen([sys.executable, "-c", RESPONDER, server.url], stdout=subprocess.PIPE,
                                     text=True, cwd=Path(__file__).resolve().parent.parent)
        try:
            assert responder.stdout is not None and responder.stdout.readline().strip() == "ready"
            result = asyncio.run(measure(server.url, args.rows, args.hidden, args.samples))
        finally:
            responder.kill()
            responder.wait()
    print(f"[{args.rows}, {args.hidden}] float32 ({result['payload_bytes']} B): frame round trip "
          f"{result['frame_round_trip_ms']:.3f} ms, bare request/reply {result['bare_round_trip_ms']:.3f} ms, "
          f"ratio {result['ratio']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

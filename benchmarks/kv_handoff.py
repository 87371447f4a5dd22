"""The P/D KV handoff, measured: bytes and milliseconds per request by prompt length, beside bare gloo.

One `aflex up` with 2 attention and 2 FFN workers and `--provision-kinds pd` (a prefill and a decode
attention worker, each with an FFN worker), the default model unless `--model`. For each prompt
length, `--requests` completions (token-id prompts, `max_tokens` 4, EOS ignored) go one at a time;
after each, the gateway's /metrics counters `aflex_kv_handoff_bytes_total` and
`aflex_kv_handoff_seconds_total` give that request's handoff: the bytes of its KV and the prefill
worker's time from the scheduler's request to the decode worker's acknowledgement (gather, connect
on the first one, send over torch.distributed, acknowledgement). Beside it, the bare transport: the
same bytes one way on a two-process gloo group and a 16-byte answer back (`BARE_GLOO_ONE_WAY`). The
median over the requests is reported. Every figure is measured on this machine's CPUs (gloo over
loopback TCP); on GPUs the KV goes on NCCL.

    python benchmarks/kv_handoff.py [--model default] [--prompts 64,256,1024] [--requests 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from shared.transport.nats_server import free_port
from tools.launch import aflex_up, until_pd_plan

BARE_GLOO_ONE_WAY = """
import datetime, statistics, sys, time, torch
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.distributed_c10d import ProcessGroupGloo
rank, port, nbytes, samples = (int(a) for a in sys.argv[1:5])
store = TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
pg = ProcessGroupGloo(PrefixStore("bench", store), rank, 2, datetime.timedelta(seconds=60))
payload, ack = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
times = []
for i in range(samples + 5):
    t = time.perf_counter()
    if rank == 0:
        pg.send([payload], 1, 1).wait()
        pg.recv([ack], 1, 2).wait()
    else:
        pg.recv([payload], 0, 1).wait()
        pg.send([ack], 0, 2).wait()
    times.append(time.perf_counter() - t)
if rank == 0:
    print(statistics.median(times[5:]), flush=True)
"""


def bare_gloo_s(nbytes: int, samples: int = 20) -> float:
    """Median seconds of `nbytes` one way and 16 bytes back between two fresh processes."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", BARE_GLOO_ONE_WAY, str(rank), str(port), str(nbytes),
                               str(samples)], stdout=subprocess.PIPE, text=True) for rank in (0, 1)]
    out, _ = procs[0].communicate(timeout=300)
    procs[1].wait(timeout=60)
    return float(out.strip())


def counters(metrics_url: str) -> dict[str, float]:
    text = httpx.get(metrics_url, timeout=10).text
    return {name: float(m.group(1)) if (m := re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)) else 0.0
            for name in ("aflex_kv_handoffs_total", "aflex_kv_handoff_bytes_total", "aflex_kv_handoff_seconds_total")}


def settled(metrics_url: str, handoffs: float, deadline_s: float = 20.0) -> dict[str, float]:
    """The counters once they show `handoffs` handoffs (telemetry comes a few times a second)."""
    deadline = time.monotonic() + deadline_s
    while (now := counters(metrics_url))["aflex_kv_handoffs_total"] < handoffs:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the handoff counter stayed at {now['aflex_kv_handoffs_total']:.0f}, "
                               f"expected {handoffs:.0f}")
        time.sleep(0.2)
    return now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompts", default="64,256,1024")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    prompts = [int(p) for p in args.prompts.split(",")]
    rows = []
    with aflex_up(args.model, "--attention-workers", "2", "--ffn-workers", "2", "--provision-window-s", "2",
                  "--provision-kinds", "pd", "--gpu-profile", "a800", open_nats=True) as mesh:
        asyncio.run(until_pd_plan(mesh))
        client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        metrics_url = f"{mesh.base_url.removesuffix('/v1')}/metrics"
        seen = counters(metrics_url)
        for n in prompts:
            nbytes, ms = [], []
            for i in range(args.requests):
                ids = [100 + (7 * i + j) % 1000 for j in range(n)]
                client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
                now = settled(metrics_url, seen["aflex_kv_handoffs_total"] + 1)
                nbytes.append(now["aflex_kv_handoff_bytes_total"] - seen["aflex_kv_handoff_bytes_total"])
                ms.append((now["aflex_kv_handoff_seconds_total"] - seen["aflex_kv_handoff_seconds_total"]) * 1e3)
                seen = now
            size = int(statistics.median(nbytes))
            row = {"prompt_tokens": n, "kv_bytes": size, "handoff_ms_median": statistics.median(ms),
                   "handoff_ms_all": ms, "bare_gloo_ms": bare_gloo_s(size) * 1e3}
            rows.append(row)
            print(f"{n:6d} tokens: {size / 1e6:8.2f} MB, handoff {row['handoff_ms_median']:7.2f} ms "
                  f"(bare gloo {row['bare_gloo_ms']:6.2f} ms)", flush=True)
    report = {"model": args.model, "measured": "wall clock on this machine's CPUs (gloo over loopback)",
              "rows": rows}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

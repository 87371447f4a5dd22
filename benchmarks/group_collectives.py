"""A worker group's collectives per layer, measured on a group of 2 and set beside what the simulator charges.

Two processes form a `DeviceGroup` (gloo over loopback TCP on this machine's CPUs; NCCL on GPUs) and time
each collective a layer costs the live mesh (`pipeline.group_collectives`: a command's head, the rows it
carries, the all-reduce, the FFN step's energy sum) at several microbatch sizes of the model's hidden width.
The per-layer sums for an attention group and an FFN group are printed beside the simulator's charge
(`pipeline.group_layer_s`) at the link the measurements fit (least squares of time on bytes: latency and
bandwidth). The bytes and calls per layer are the ones tests/test_worker_groups.py holds equal to a live
group's; the times are this machine's.

    python benchmarks/group_collectives.py [--dim 576] [--tokens 1,16,256,2048] [--samples 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from shared.policy.pipeline import collective_s, group_collectives, group_layer_s
from shared.transport.device_group import DeviceGroup

DTYPE_BYTES = 4  # float32, the CPU mesh's dtype


def _time(group: DeviceGroup, kind: str, nbytes: int, samples: int) -> float:
    """Median seconds of one collective of `kind` moving `nbytes`, on this rank (every rank runs the same)."""
    x = torch.zeros(max(1, nbytes // DTYPE_BYTES), dtype=torch.float32)
    times = []
    for _ in range(samples + 3):  # the first few warm the connection
        t = time.perf_counter()
        if kind == "all-reduce":
            group.all_reduce(x)
        elif kind == "sum":
            group.sum_float(1.0)
        else:
            group._broadcast(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times[3:])


def _rank(rank: int, address: str, sizes: list[tuple[str, int]], samples: int, out: Any) -> None:
    group = DeviceGroup.join(address, rank, 2, torch.device("cpu"), 60.0)
    measured = {f"{kind}/{nbytes}": _time(group, kind, nbytes, samples) for kind, nbytes in sizes}
    if rank == 1:
        out.put(measured)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=576, help="hidden width (576: SmolLM2-135M, the default model)")
    ap.add_argument("--tokens", default="1,16,256,2048", help="microbatch rows")
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    tokens = [int(t) for t in a.tokens.split(",")]
    sizes = sorted({(k, int(b)) for t in tokens for side in ("attention", "ffn")
                    for k, b in group_collectives(side, t, a.dim, 2, DTYPE_BYTES)})
    store, address = DeviceGroup.open_store(advertise="127.0.0.1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    follower = ctx.Process(target=_rank, args=(1, address, sizes, a.samples, out))
    follower.start()
    leader = DeviceGroup(store, 0, 2, torch.device("cpu"), 60.0, address)
    for kind, nbytes in sizes:
        _time(leader, kind, nbytes, a.samples)
    measured: dict[str, float] = out.get(timeout=300)
    follower.join(60)
    # the link these times fit: t = latency + bytes / bandwidth (an all-reduce of 2 ranks moves its bytes once)
    xs = [float(b) for k, b in sizes if k != "sum"]
    ys = [measured[f"{k}/{b}"] for k, b in sizes if k != "sum"]
    fit = statistics.linear_regression(xs, ys)
    link_bytes_s, latency_s = 1.0 / fit.slope, max(0.0, fit.intercept)
    rows = []
    machine = _machine()
    print(f"{machine['cpu']} ({machine['cores']} cores): a group of 2, gloo; dim {a.dim}, float32; "
          f"fit: latency {latency_s * 1e6:.0f} us, {link_bytes_s / 1e9:.2f} GB/s")
    print(f"{'side':<10} {'tokens':>6} {'calls':>5} {'bytes':>10} {'measured ms':>12} {'charged ms':>11}")
    for side in ("attention", "ffn"):
        for t in tokens:
            ops = group_collectives(side, t, a.dim, 2, DTYPE_BYTES)
            got_s = sum(measured[f"{k}/{int(b)}"] for k, b in ops)
            fitted_s = sum(collective_s(k, b, 2, link_bytes_s, latency_s) for k, b in ops)
            charged_s = group_layer_s(side, t, a.dim, 2, link_bytes_s, dtype_bytes=DTYPE_BYTES)
            rows.append({"side": side, "tokens": t, "calls": len(ops), "bytes": int(sum(b for _, b in ops)),
                         "measured_ms": got_s * 1e3, "charged_ms_at_fit": fitted_s * 1e3,
                         "charged_ms_default_latency": charged_s * 1e3})
            print(f"{side:<10} {t:>6} {len(ops):>5} {rows[-1]['bytes']:>10} {got_s * 1e3:>12.3f} "
                  f"{fitted_s * 1e3:>11.3f}")
    result = {"dim": a.dim, "dtype_bytes": DTYPE_BYTES, "link_fit": {"latency_s": latency_s,
                                                                     "link_bytes_s": link_bytes_s},
              "per_collective_s": measured, "per_layer": rows, "machine": machine}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


def _machine() -> dict[str, Any]:
    """The machine the times are this machine's of (a time without its machine is not reported)."""
    import os
    import platform
    from pathlib import Path

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": sys.version.split()[0],
            "platform": platform.platform()}


if __name__ == "__main__":
    main()

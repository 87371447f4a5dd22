"""The whole mesh on one machine's GPU: per-half times, the seam hop, and energy per token.

`aflex up` with 1 attention + 1 FFN worker on `--device` (cuda: the workers share the host's GPUs;
on a single-GPU host both halves sit on one GPU, NCCL cannot pair a GPU with itself, and the seam
falls back to host tensors on gloo, which the workers log and this report records) and the
`--gpu-backend` (nvml-readonly on a lent GPU: clocks, power limits and modes are only read, never
set). `--concurrency` greedy streams decode `--max-tokens` tokens each (EOS ignored), after a
warm-up request.

Reported, from the decode microbatches' `MicrobatchDone` (every sequence seen before, all rows):
per layer the attention time, the FFN compute time (the FFN worker's own forward, reported in its
replies) and the hop = (ffn_wait - ffn_compute) / n_layers. Energy per token: with a real GPU,
*measured*, the NVML total-energy counter of every visible GPU, read here before and after the
streams (whole-device accounting: idle, prefill and both halves included, as the GPU draws it),
divided by the completion tokens; with the emulated backend, *modelled*, the decode microbatches'
reported energy divided by the decoded tokens (each stream's first token is prefill).

    python benchmarks/gpu_mesh_check.py [--device cuda] [--gpu-backend nvml-readonly] [--json out.json]
    python benchmarks/gpu_mesh_check.py --groups "--ffn-tp 2"      # two GPUs or more: an FFN group on NCCL
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from shared import subjects
from shared.messages import MicrobatchDone, decode
from shared.model.checkpoint import open_checkpoint
from tools.launch import aflex_up

PROMPT = "Write a short story about a lighthouse keeper."
FALLBACK_LOG = "both halves on one GPU"


class EnergyCounter:
    """The NVML total-energy counter summed over the visible GPUs (read only); None where there is none."""

    def __init__(self, enabled: bool) -> None:
        self._handles: list[Any] = []
        if not enabled:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._pynvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # no NVML here: nothing measured
            self._handles = []

    def read_j(self) -> float | None:
        if not self._handles:
            return None
        return sum(self._pynvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self._handles) / 1e3


async def decode_window(port: int, nats_port: int, concurrency: int, max_tokens: int, counter: EnergyCounter
                        ) -> dict[str, Any]:
    import nats
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600.0, max_retries=0)
    model = (await client.models.list()).data[0].id

    async def stream(n: int) -> tuple[float, float, int]:
        first = last = 0.0
        tokens = 0
        response = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=n, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in response:
            if chunk.choices:
                first, last = first or time.perf_counter(), time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return first, last, tokens

    await stream(4)  # warm-up
    seen: set[str] = set()
    dones: list[MicrobatchDone] = []
    nc = await nats.connect(f"nats://127.0.0.1:{nats_port}")

    async def on_done(msg: Any) -> None:
        done = decode(MicrobatchDone, msg.data)
        ids = {r.seq_id for r in done.results}
        if done.error is None and ids and ids <= seen:
            dones.append(done)
        seen.update(ids)

    await nc.subscribe(subjects.SCHED_DONE, cb=on_done)
    await nc.flush()
    energy0, started = counter.read_j(), time.perf_counter()
    streams = await asyncio.gather(*(stream(max_tokens) for _ in range(concurrency)))
    energy1, elapsed = counter.read_j(), time.perf_counter() - started
    await nc.flush()
    await nc.close()
    await client.close()
    return {"streams": streams, "dones": dones, "elapsed_s": elapsed,
            "gpu_energy_j": None if energy0 is None or energy1 is None else energy1 - energy0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gpu-backend", default="nvml-readonly", choices=["nvml-readonly", "emulated"])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--groups", default="", help="`aflex up`'s group flags, e.g. \"--ffn-tp 2\" on two GPUs (each "
                                                     "group's rank r on cuda:r: its all-reduces and commands on NCCL)")
    args = parser.parse_args()

    counter = EnergyCounter(args.gpu_backend == "nvml-readonly")
    n_layers = open_checkpoint(args.model).args.n_layers
    with aflex_up(args.model, "--attention-workers", "1", "--ffn-workers", "1", "--microbatch-depth", "1",
                  "--device", args.device, "--gpu-backend", args.gpu_backend, *args.groups.split(),
                  open_nats=True) as mesh:  # it watches sched.done, which no role but the scheduler reads
        window = asyncio.run(decode_window(mesh.port, mesh.nats_port, args.concurrency, args.max_tokens, counter))
        log = mesh.output()
    dones = [d for d in window["dones"] if len(d.results) == args.concurrency]
    decoded = sum(tokens - 1 for _, _, tokens in window["streams"])
    report: dict[str, Any] = {
        "device": args.device, "gpu_backend": args.gpu_backend, "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "decode_microbatches": len(dones), "groups": args.groups,
        "group_logs": [line.strip()[:200] for line in log.splitlines() if "worker group of" in line or
                       "joined gloo://" in line],
        "seam": "gloo, host tensors (both halves on one GPU)" if FALLBACK_LOG in log else
                ("gloo + nccl" if "gloo + nccl" in log else "gloo"),
    }
    if dones:
        layers = n_layers
        report |= {
            "n_layers": n_layers,
            "attention_per_layer_ms": round(statistics.median(d.attention_s for d in dones) / layers * 1e3, 3),
            "ffn_compute_per_layer_ms": round(statistics.median(d.ffn_compute_s for d in dones) / layers * 1e3, 3),
            "hop_per_layer_ms": round(statistics.median((d.ffn_wait_s - d.ffn_compute_s) for d in dones)
                                      / layers * 1e3, 3),
            "step_ms": round(statistics.median(d.total_s for d in dones) * 1e3, 2),
        }
    if window["gpu_energy_j"] is not None:
        generated = sum(tokens for _, _, tokens in window["streams"])
        report["energy_per_token_j"] = round(window["gpu_energy_j"] / generated, 4)
        report["energy_accounting"] = ("measured: NVML total-energy counter of every visible GPU over the whole "
                                       "window (idle, prefill and both halves), per completion token")
    else:
        modelled = sum(d.energy_j or 0.0 for d in window["dones"])
        report["energy_per_token_j"] = round(modelled / max(1, decoded), 4)
        report["energy_accounting"] = ("modelled: the emulated GPUs' energy of the decode microbatches, as the "
                                       "workers report it, per token decoded")
    report["decode_tok_s"] = round(decoded / window["elapsed_s"], 1)
    print(json.dumps(report, indent=2), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

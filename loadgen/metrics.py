"""Benchmark metrics exactly as vLLM's `vllm bench serve` defines them (`calculate_metrics`), plus SLOs.

Per request (measured by the client, see client.py): `ttft` (first SSE message with non-empty
`choices`), `itl` (gaps between consecutive `choices` messages: one entry per chunk), `latency` = E2EL
(last non-[DONE] message, the usage chunk included), `output_tokens` (`usage.completion_tokens`).

Aggregates over successful requests: TPOT = (E2EL - TTFT) / (output_tokens - 1) when output_tokens > 1
(the stats are over requests; for goodput a request with one token has TPOT 0); mean, median, std
(population) and percentiles (numpy, linear) in ms; throughputs over the benchmark duration;
`request_goodput` = requests meeting every given SLO / duration (DistServe's goodput, vLLM's
`--goodput ttft:MS tpot:MS e2el:MS`). Ours: `slo_attainment` = good requests / all requests sent
(failed ones count as missing the SLO).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (99.0,)


@dataclass
class RequestResult:
    """One request as the client saw it (times in seconds, `start_time` from time.perf_counter())."""

    index: int
    input_len: int  # requested prompt tokens
    output_len: int  # requested output tokens
    success: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL
    output_tokens: int | None = None  # usage.completion_tokens
    prompt_tokens: int | None = None  # usage.prompt_tokens (a check that the prompt had the asked length)
    energy_j: float | None = None  # usage.energy_j, where the server gives it
    start_time: float = 0.0
    generated_text: str = ""
    chunks: int = 0
    error: str = ""


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> {"ttft": 200.0, "tpot": 50.0} (ms)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {item!r} is not a number of milliseconds") from None
        if ms < 0:
            raise ValueError(f"--goodput: {item!r} must not be negative")
        slos[name] = ms
    return slos


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _stats(name: str, values: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    data = values or [0.0]  # vLLM: np.mean(x or 0)
    out = {
        f"mean_{name}_ms": float(np.mean(data)) * 1000,
        f"median_{name}_ms": float(np.median(data)) * 1000,
        f"std_{name}_ms": float(np.std(data)) * 1000,
    }
    for p in percentiles:
        out[f"p{_pword(p)}_{name}_ms"] = float(np.percentile(data, p)) * 1000
    return out


def output_len_of(result: RequestResult) -> int:
    """The output length vLLM uses: usage.completion_tokens, else the number of content chunks."""
    return result.output_tokens if result.output_tokens else result.chunks


def tpot_of(result: RequestResult) -> float | None:
    n = output_len_of(result)
    return (result.latency - result.ttft) / (n - 1) if n > 1 else None


def is_good(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """A successful request meeting every given SLO (vLLM: `slo >= value`)."""
    if not result.success:
        return False
    values = {"ttft": result.ttft, "tpot": tpot_of(result) or 0.0, "e2el": result.latency}
    return all(values[name] <= ms / 1000 for name, ms in slos_ms.items())


def peak_buckets(results: Sequence[RequestResult]) -> tuple[float, int]:
    """vLLM's max_output_tokens_per_s and max_concurrent_requests, over 1-s buckets from the first start."""
    ok = [r for r in results if r.success]
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    t1 = max(r.start_time + r.latency for r in ok)
    n = int(np.ceil(t1 - t0)) + 1
    tokens = np.zeros(n)
    active = np.zeros(n)
    for r in ok:
        times = np.concatenate(([r.start_time + r.ttft], r.start_time + r.ttft + np.cumsum(r.itl)))
        for t in times:
            b = int(t - t0)
            if 0 <= b < n:
                tokens[b] += 1
        for b in range(int(r.start_time - t0), int(r.start_time + r.latency - t0) + 1):
            if 0 <= b < n:
                active[b] += 1
    return float(tokens.max()), int(active.max())


def calculate_metrics(results: Sequence[RequestResult], duration_s: float, *,
                      goodput_slos_ms: dict[str, float] | None = None,
                      percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """vLLM's result fields (names and arithmetic), plus `slo_attainment` and a few counts of ours."""
    completed = failed = good = 0
    total_input = 0
    output_lens: list[int] = []
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    for r in results:
        if not r.success:
            failed += 1
            output_lens.append(0)
            continue
        completed += 1
        n = output_len_of(r)
        output_lens.append(n)
        total_input += r.input_len
        tpot = tpot_of(r)
        if tpot is not None:
            tpots.append(tpot)
        itls.extend(r.itl)
        ttfts.append(r.ttft)
        e2els.append(r.latency)
        if goodput_slos_ms and is_good(r, goodput_slos_ms):
            good += 1
    total_output = sum(output_lens)
    dur = duration_s if duration_s > 0 else math.nan
    max_tok_s, max_conc = peak_buckets(results)
    metrics: dict[str, Any] = {
        "duration": duration_s,
        "completed": completed,
        "failed": failed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / dur,
        "request_goodput": good / dur if goodput_slos_ms else None,
        "output_throughput": total_output / dur,
        "total_token_throughput": (total_input + total_output) / dur,
        "max_output_tokens_per_s": max_tok_s,
        "max_concurrent_requests": max_conc,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        metrics.update(_stats(name, values, percentiles))
    # ours
    metrics["slo_attainment"] = good / len(results) if goodput_slos_ms and results else None
    metrics["goodput_slos_ms"] = dict(goodput_slos_ms) if goodput_slos_ms else None
    metrics["output_len_mismatches"] = sum(1 for r in results if r.success and output_len_of(r) != r.output_len)
    metrics["prompt_len_mismatches"] = sum(1 for r in results if r.success and r.prompt_tokens is not None
                                           and r.prompt_tokens != r.input_len)
    return metrics


def usage_energy(results: Sequence[RequestResult]) -> float | None:
    """Σ usage.energy_j over successful requests; None when no request reported it."""
    values = [r.energy_j for r in results if r.success and r.energy_j is not None]
    return float(sum(values)) if values else None

"""The summary table, the result JSON (vLLM's field names plus ours) and the plots."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.energy import Sample
from loadgen.metrics import METRICS, RequestResult

TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
          "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.2f}"
    return str(value)


def summary_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = [
        ("Successful requests", _fmt(result["completed"])),
        ("Failed requests", _fmt(result["failed"])),
        ("Benchmark duration (s)", _fmt(result["duration"])),
        ("Total input tokens", _fmt(result["total_input_tokens"])),
        ("Total generated tokens", _fmt(result["total_output_tokens"])),
        ("Request throughput (req/s)", _fmt(result["request_throughput"])),
    ]
    if result.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", _fmt(result["request_goodput"])))
        rows.append(("SLO attainment (%)", _fmt(100.0 * result["slo_attainment"])))
    rows += [
        ("Output token throughput (tok/s)", _fmt(result["output_throughput"])),
        ("Peak output token throughput (tok/s)", _fmt(result["max_output_tokens_per_s"])),
        ("Peak concurrent requests", _fmt(result["max_concurrent_requests"])),
        ("Total token throughput (tok/s)", _fmt(result["total_token_throughput"])),
    ]
    for name in METRICS:
        keys = [k for k in result if k.endswith(f"_{name}_ms") and not k.startswith("std_")]
        rows += [(f"{TITLES[name]}: {k.removesuffix(f'_{name}_ms').replace('_', ' ')} (ms)", _fmt(result[k]))
                 for k in keys]
    rows += [
        ("Energy (J)", _fmt(result.get("energy_j"))),
        ("Energy source", _fmt(result.get("energy_source"))),
        ("Energy per output token (J/tok)", _fmt(result.get("energy_per_token_j"))),
        ("Average power (W)", _fmt(result.get("avg_power_w"))),
    ]
    return rows


def print_summary(result: dict[str, Any]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is a base dependency
        for name, value in summary_rows(result):
            print(f"{name:<60}{value:>14}")
        return
    table = Table(title="Serving Benchmark Result", show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in summary_rows(result):
        table.add_row(name, value)
    Console().print(table)


def write_json(result: dict[str, Any], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def default(obj: Any) -> Any:
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(f"not JSON serialisable: {type(obj).__name__}")

    def clean(obj: Any) -> Any:  # NaN/inf are not JSON: inf -> "inf" (as vLLM writes request_rate), NaN -> null
        if isinstance(obj, float) and not math.isfinite(obj):
            return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
        if isinstance(obj, dict):
            return {k: clean(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return [clean(v) for v in obj]
        return obj

    path.write_text(json.dumps(clean(result), indent=2, default=default) + "\n")


def write_plots(directory: str | Path, results: Sequence[RequestResult], samples: Sequence[Sample],
                t_origin: float) -> list[Path]:
    """Latency CDFs; output throughput, power and clocks over time. Needs matplotlib (pip install matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plots needs matplotlib: pip install matplotlib") from exc
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ok = [r for r in results if r.success]
    written: list[Path] = []

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (n - 1) for r in ok if (n := (r.output_tokens or r.chunks)) > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        if values:
            xs = np.sort(np.asarray(values) * 1000)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs))
        ax.set_xlabel(f"{name.upper()} (ms)")
        ax.set_ylabel("CDF")
        ax.set_title(TITLES[name], fontsize=9)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    written.append(directory / "latency_cdf.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    token_times = [r.start_time + r.ttft + t for r in ok for t in np.concatenate(([0.0], np.cumsum(r.itl)))]
    if token_times:
        end = max(token_times)
        bins = np.arange(0.0, end + 1.0, 1.0)
        counts, edges = np.histogram(token_times, bins=bins)
        axes[0].step(edges[:-1], counts, where="post")
    axes[0].set_ylabel("output chunks/s")
    axes[0].set_title("Throughput, power and clocks over time")
    by_worker: dict[str, list[Sample]] = {}
    for s in samples:
        by_worker.setdefault(s.worker_id, []).append(s)
    for wid, ws in sorted(by_worker.items()):
        ts = [s.t - t_origin for s in ws]
        axes[1].plot(ts, [s.power_w for s in ws], label=wid)
        axes[2].plot(ts, [s.clock_mhz for s in ws], label=wid)
    axes[1].set_ylabel("power (W)")
    axes[2].set_ylabel("SM clock (MHz)")
    axes[2].set_xlabel("time since start (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    if by_worker:
        axes[1].legend(fontsize=8)
    else:
        axes[1].text(0.5, 0.5, "no telemetry (give --nats URL)", transform=axes[1].transAxes, ha="center")
    fig.tight_layout()
    written.append(directory / "timeline.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    return written

"""PNG plots for `aflex sim --plots DIR`: clocks over time, and energy per token against load."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any


def write_plots(directory: Path, out: dict[str, Any], timelines: dict[str, Any], args: argparse.Namespace,
                load_scales: tuple[float, ...] = (2.0, 1.0, 0.5)) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from loadgen.sim.cli import run_policies

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, axes = plt.subplots(len(timelines), 1, figsize=(9, 2.2 * max(1, len(timelines))), squeeze=False)
    for ax, (name, tl) in zip(axes[:, 0], timelines.items(), strict=True):
        pts = tl["clocks"]
        if pts:
            ts = [p[0] for p in pts]
            ax.plot(ts, [p[2] for p in pts], ".", ms=2, label="attention")
            ax.plot(ts, [p[3] for p in pts], ".", ms=2, label="ffn")
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("MHz")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    p = directory / "clocks_over_time.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    # energy per token against load: rerun at other time scales (smaller scale = higher load)
    series: dict[str, list[tuple[float, float]]] = {}
    for scale in load_scales:
        a = copy.copy(args)
        a.time_scale = args.time_scale * scale
        if not args.trace:
            a.rate = args.rate / scale
        res = run_policies(a)
        for name, r in res["policies"].items():
            series.setdefault(name, []).append((res["requests"] / max(r["makespan_s"], 1e-9), r["energy_per_token_j"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in series.items():
        pts.sort()
        ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=name)
    ax.set_xlabel("load (requests/s)")
    ax.set_ylabel("energy per token (J)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = directory / "energy_vs_load.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths

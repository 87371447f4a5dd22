"""PNG plots for `aflex sim --plots DIR`: clocks and plan shapes over time, and energy per token against load."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_plots(directory: Path, timelines: dict[str, Any], sweep: dict[str, dict[str, Any]]) -> list[Path]:
    """`clocks_over_time.png` from the runs' timelines and `energy_vs_load.png` from `sweep[load][policy]`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    paths.append(plot_plans(directory / "plans_over_time.png", {k: tl.get("plans", []) for k, tl in timelines.items()}))
    paths.append(plot_energy_vs_load(directory / "energy_vs_load.png", sweep))
    return paths


KIND_COLOURS = {"pd": "tab:blue", "mixed": "tab:orange", "colocated": "tab:green", "pd-colocated": "tab:purple"}


def plot_plans(path: Path, plans: dict[str, list[dict[str, Any]]]) -> Path:
    """The GPUs each policy's plan holds over time, coloured by the plan's kind (P/D, mixed, colocated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(plans), 1, figsize=(9, 1.8 * max(1, len(plans))), squeeze=False, sharex=True)
    # a plan holds until the next; every policy's last one until the last re-plan of any (a static plan's
    # one plan holds for the whole run), plus one window
    end_s = max((steps[-1]["t_s"] for steps in plans.values() if steps), default=0.0) + 300.0
    for ax, (name, steps) in zip(axes[:, 0], plans.items(), strict=True):
        for i, step in enumerate(steps):
            end = steps[i + 1]["t_s"] if i + 1 < len(steps) else end_s
            # split pools are [attention, ffn, attention TP]; colocated ones [replicas, TP]
            gpus = sum(v[0] + v[1] if len(v) == 3 else v[0] * v[1]
                       for k, v in step.items() if k in ("prefill", "decode", "mixed", "colocated"))
            kind = step.get("kind", "pd")
            ax.fill_between([step["t_s"], end], 0, gpus, step="pre", color=KIND_COLOURS.get(kind, "grey"), alpha=0.6,
                            label=kind)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper right")
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("GPUs in plan")
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_energy_vs_load(path: Path, sweep: dict[str, dict[str, Any]], title: str = "") -> Path:
    """Energy per token against load for every policy, one panel per accounting; `sweep[load][policy]`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes2 = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
    for ax, accounting in zip(axes2[0], ("cluster", "active"), strict=True):
        series: dict[str, list[tuple[float, float]]] = {}
        for load, policies in sweep.items():
            for name, r in policies.items():
                series.setdefault(name, []).append((float(load), r["accounting"][accounting]["energy_per_token_j"]))
        for name, pts in series.items():
            pts.sort()
            ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("load (x the trace's arrival rate)")
        ax.set_ylabel("energy per token (J, modelled)")
        ax.set_title(f"{accounting} accounting", fontsize=9)
    axes2[0, 0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""The regime map: where the A/F split and per-operator clocks pay, over models, GPUs, loads, SLOs and contexts.

Each cell replays one workload on the simulator (every figure modelled from the emulated GPU profiles,
never measured; cluster accounting: every GPU of the deployment, parked ones at their parked power) for
AFlex, its per-pool-clock ablation (`aflex-no-opfreq`: one clock for both halves of a pool, chosen the same
way) and the rivals as their papers describe them (DynamoLLM, BiScale, DistServe). Per cell it reports each
policy's J/token and whether it met both P90 SLOs, the kinds AFlex ran (share of the replay) and its mean
clocks, what per-operator clocks saved over per-pool ones (online, the same planner; not a hindsight
search, which takes ~25 replays a cell), and AFlex against the best SLO-meeting rival.

The axes (`MODELS`, `GPUS`, `LOADS`, `SLOS`, `CONTEXTS`) make 360 cells; the map replays a sample of them
(`cells()`): one factor at a time around the paper's cell (Qwen3-32B, A800, ×1, the paper's SLOs, Conversation),
then every model with every context, the GPU, load and SLO rotating through their values so that each value
appears about equally often. Each replay is the trace's first `--window-s` seconds (1200 by default), at the
load's multiple of its rate; long context is the synthetic agentic/RAG workload (8-32K-token prompts) at
0.3 req/s times the load, its TTFT limit ten times the SLO set's. Traces: Azure LLM inference traces 2023
(`AFLEX_TRACES_DIR`, ../shared/traces).

    python benchmarks/regime_map.py --json out/regime_map.json --md out/regime_map.md
    python benchmarks/regime_map.py --sample axes   # the one-factor-at-a-time cells only
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadgen.sim.cli import add_sim_arguments, run_policies  # noqa: E402

# each model at the GPUs it is deployed on (80 GB class): the whole model fits a TP8 replica or its split groups
MODELS = {"qwen3-32b": 16, "mixtral-8x7b": 16, "llama-3.3-70b": 16, "qwen3-30b-a3b": 8, "qwen3-235b-a22b": 16}
GPUS = ("a800", "h100", "h200", "b200")
LOADS = (0.25, 0.5, 1.0, 2.0, 4.0)
# P90 TTFT / TPOT limits (ms): the AFlex paper's, and MLPerf Inference's interactive scenario (Llama-2-70B)
SLOS = {"paper": (400.0, 120.0), "interactive": (450.0, 40.0)}
CONTEXTS = ("conv", "code", "long")
LONG_TTFT_FACTOR = 10.0  # long context's TTFT limit: the set's times this (its prompts are ~20x Conversation's)
LONG_RATE_RPS = 0.3  # the long-context workload's rate at x1
AFLEX, PER_POOL = "aflex", "aflex-no-opfreq"
RIVALS = ("dynamollm", "biscale", "distserve")
POLICIES = (AFLEX, PER_POOL, *RIVALS)
TIE = 0.01  # within 1% of the lowest SLO-meeting policy counts as first
LEAD = 0.10  # a lead worth naming


@dataclass(frozen=True)
class Cell:
    model: str
    gpu: str
    load: float
    slo: str
    context: str

    @property
    def name(self) -> str:
        return f"{self.model} {self.gpu} x{self.load:g} {self.slo} {self.context}"


BASE = Cell("qwen3-32b", "a800", 1.0, "paper", "conv")


def cells(sample: str) -> list[Cell]:
    """The cells replayed: "axes" (one factor at a time around `BASE`) or "map" (those, then every model x
    context with the GPU, load and SLO rotating)."""
    out = [BASE]
    out += [Cell(m, BASE.gpu, BASE.load, BASE.slo, BASE.context) for m in MODELS]
    out += [Cell(BASE.model, g, BASE.load, BASE.slo, BASE.context) for g in GPUS]
    out += [Cell(BASE.model, BASE.gpu, x, BASE.slo, BASE.context) for x in LOADS]
    out += [Cell(BASE.model, BASE.gpu, BASE.load, s, BASE.context) for s in SLOS]
    out += [Cell(BASE.model, BASE.gpu, BASE.load, BASE.slo, c) for c in CONTEXTS]
    if sample == "map":
        slos = list(SLOS)
        for k, (m, c) in enumerate((m, c) for m in MODELS for c in CONTEXTS):
            out.append(Cell(m, GPUS[k % len(GPUS)], LOADS[(k * 2 + 1) % len(LOADS)], slos[k % 2], c))
    return list(dict.fromkeys(out))


def _args(cell: Cell, window_s: float) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    ttft, tpot = SLOS[cell.slo]
    ttft *= LONG_TTFT_FACTOR if cell.context == "long" else 1.0
    work = (["--trace", "long-context", "--rate", f"{LONG_RATE_RPS * cell.load}", "--duration", f"{window_s}"]
            if cell.context == "long" else ["--trace", cell.context, "--window", f"0:{window_s}",
                                            "--time-scale", f"{1.0 / cell.load}"])
    return parser.parse_args([*work, "--model", cell.model, "--gpu", cell.gpu, "--gpus", str(MODELS[cell.model]),
                              "--ttft-slo-ms", f"{ttft}", "--tpot-slo-ms", f"{tpot}", "--policies",
                              ",".join(POLICIES)])


def kind_shares(plans: list[dict[str, Any]], end_s: float) -> dict[str, float]:
    """Each plan kind's share of the replay (plans hold from their `t_s` to the next)."""
    spans: dict[str, float] = {}
    for plan, nxt in zip(plans, [*plans[1:], {"t_s": end_s}], strict=True):
        spans[plan["kind"]] = spans.get(plan["kind"], 0.0) + max(0.0, float(nxt["t_s"]) - float(plan["t_s"]))
    total = sum(spans.values()) or 1.0
    return {k: round(v / total, 2) for k, v in sorted(spans.items(), key=lambda kv: -kv[1])}


def replay(job: tuple[Cell, float]) -> dict[str, Any]:
    cell, window_s = job
    t0 = time.perf_counter()
    runs = run_policies(_args(cell, window_s))["policies"]
    out: dict[str, Any] = {"cell": asdict(cell), "wall_s": 0.0, "policies": {}}
    for name, res in runs.items():
        out["policies"][name] = {"j_per_token": res["energy_per_token_j"], "slo_met": bool(res["slo_met"]),
                                 "p90_ttft_ms": res["p90_ttft_ms"], "p90_tpot_ms": res["p90_tpot_ms"]}
    aflex = runs[AFLEX]
    out["aflex_kinds"] = kind_shares(aflex["plans"], aflex["makespan_s"])
    out["aflex_clocks_mhz"] = {k: round(v) if v else None for k, v in aflex["mean_clock_mhz"].items()}
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out | verdict(out["policies"])


def verdict(policies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """AFlex against the rivals: the best SLO-meeting rival, AFlex's lead over it, and whether AFlex is the
    lowest SLO-meeting policy or within `TIE` of it; per-operator clocks against per-pool ones."""
    a, pool = policies[AFLEX], policies[PER_POOL]
    met = {n: r["j_per_token"] for n, r in policies.items() if r["slo_met"] and n in RIVALS}
    best = min(met, key=lambda n: met[n]) if met else None
    lead = (met[best] / a["j_per_token"] - 1.0) if best is not None and a["slo_met"] else None
    lowest = min([*met.values(), *([a["j_per_token"]] if a["slo_met"] else [])], default=None)
    first = a["slo_met"] and lowest is not None and a["j_per_token"] <= lowest * (1.0 + TIE)
    return {"best_rival": best, "lead": lead, "first": first or (not met and not a["slo_met"]),
            "per_operator_gain": 1.0 - a["j_per_token"] / pool["j_per_token"]}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| cell (model, GPU, load, SLO, context) | AFlex J/token | SLOs | AFlex's kinds | clocks PA/PF/DA/DF "
             "| per-op vs per-pool | best SLO-meeting rival | AFlex vs it | first or within 1% |", "|" + "---|" * 9]
    for r in rows:
        a = r["policies"][AFLEX]
        best = r["best_rival"]
        rival = f"{best} {r['policies'][best]['j_per_token']:.4f}" if best else "none meets both"
        lead = f"{100 * r['lead']:+.1f}%" if r["lead"] is not None else "–"
        kinds = ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["aflex_kinds"].items())
        clocks = "/".join(str(v) if v else "–" for v in r["aflex_clocks_mhz"].values())
        lines.append(f"| {Cell(**r['cell']).name} | {a['j_per_token']:.4f} | {'yes' if a['slo_met'] else '**no**'} "
                     f"| {kinds} | {clocks} | {100 * r['per_operator_gain']:+.1f}% | {rival} | {lead} | "
                     f"{'yes' if r['first'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def summary(rows: list[dict[str, Any]]) -> str:
    first = sum(r["first"] for r in rows)
    leads = [r for r in rows if r["lead"] is not None and r["lead"] >= LEAD]
    split = [r for r in rows if any(k in ("pd", "mixed") for k in r["aflex_kinds"])]
    gains = [r["per_operator_gain"] for r in rows]
    text = [f"{len(rows)} cells: AFlex the lowest SLO-meeting policy or within 1% of it in {first}",
            f"cells where AFlex leads the best SLO-meeting rival by {100 * LEAD:.0f}% or more: "
            + (", ".join(Cell(**r["cell"]).name for r in leads) or "none"),
            f"cells where AFlex ran an A/F split plan: {len(split)}"
            + (" (" + ", ".join(Cell(**r["cell"]).name for r in split) + ")" if split else ""),
            f"per-operator against per-pool clocks: {100 * min(gains):+.1f}% to {100 * max(gains):+.1f}%"]
    return "\n".join(text) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sample", choices=("axes", "map"), default="map")
    p.add_argument("--window-s", type=float, default=1200.0, help="seconds of each trace replayed")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    a = p.parse_args(argv)
    todo = cells(a.sample)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=a.workers, mp_context=multiprocessing.get_context("fork")) as ex:
        rows = []
        for row in ex.map(replay, [(c, a.window_s) for c in todo]):
            rows.append(row)
            print(f"{Cell(**row['cell']).name}: AFlex {row['policies'][AFLEX]['j_per_token']:.4f} J/token, "
                  f"first {row['first']} ({row['wall_s']} s)", file=sys.stderr)
    wall = time.perf_counter() - t0
    text, tail = markdown(rows), summary(rows)
    print(text + "\n" + tail)
    print(f"{len(rows)} cells in {wall:.0f} s with {a.workers} workers", file=sys.stderr)
    doc = {"cells": rows, "summary": tail, "wall_s": round(wall, 1), "workers": a.workers, "window_s": a.window_s,
           "sample": a.sample, "energy_source": "modelled (emulated GPU profiles); not measured",
           "accounting": "cluster"}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    if a.md:
        Path(a.md).write_text(text + "\n" + tail)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

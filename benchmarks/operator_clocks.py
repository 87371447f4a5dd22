"""Where per-operator clocks beat per-pool clocks in hindsight, and by how much (issue 38, part 5).

For each run, AFlex's split P/D shapes (`oracle.oracle_shapes`, its split kinds only) are searched twice in
hindsight over the whole trace: with a clock per operator (attention and FFN apart, `static-oracle`'s grid)
and with one clock per pool (both halves alike, `pool-oracle`'s rule). Same shapes, same levels, same
replays of the same trace: the difference is the per-operator clocks alone. Every figure is modelled
(the emulated A800 profile), cluster accounting.

    python benchmarks/operator_clocks.py --json out/operator_clocks.json
    python benchmarks/operator_clocks.py --runs long-qwen3 --levels 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.sim.arrivals import Arrivals, load_trace, long_context
from loadgen.sim.engine import SimConfig, Simulation
from loadgen.sim.models import get_model
from loadgen.sim.oracle import oracle_shapes, search_oracle
from loadgen.sim.policies import policy_spec
from shared.gpu.emulated import load_profile
from shared.perf import cached_predictor

# run -> (arrivals, model, TTFT SLO s): the paper table's conv runs and the long-context workload
RUNS = ("conv-qwen3", "conv-mixtral", "long-qwen3", "long-qwen3-30b")


def _run(name: str) -> tuple[Arrivals, str, float]:
    if name.startswith("long-"):
        model = "qwen3-30b-a3b" if name.endswith("30b") else "qwen3-32b"
        rate = 1.5 if model == "qwen3-30b-a3b" else 0.3
        return long_context(rate, 1800.0, 0), model, 4.0
    trace, model = name.split("-", 1)
    return load_trace(trace), {"qwen3": "qwen3-32b", "mixtral": "mixtral-8x7b"}[model], 0.4


def compare(name: str, levels: int, workers: int) -> dict[str, Any]:
    arrivals, model_name, ttft_slo_s = _run(name)
    profile, model = load_profile("a800"), get_model(model_name)
    pred, cfg = cached_predictor(profile, model), SimConfig(gpus=16, ttft_slo_s=ttft_slo_s)
    probe = Simulation(profile, model, arrivals, policy_spec("aflex"), cfg, pred)
    split = [(p, d) for p, d in oracle_shapes(pred, probe.planner) if d is not None]
    out: dict[str, Any] = {"run": name, "model": model_name, "shapes": len(split)}
    for label, per_pool in (("per-operator", False), ("per-pool", True)):
        t0 = time.perf_counter()
        res = search_oracle(profile, model, arrivals, cfg, workers=workers, levels=levels, shapes=split,
                            name=label, per_pool=per_pool)
        o = res.result["oracle"]
        out[label] = {"energy_per_token_j": res.result["accounting"]["cluster"]["energy_per_token_j"],
                      "feasible": o["feasible"], "best": o["best"], "replays": o["replays"],
                      "p90_ttft_ms": res.result["p90_ttft_ms"], "p90_tpot_ms": res.result["p90_tpot_ms"],
                      "wall_s": round(time.perf_counter() - t0, 1)}
    op, pool = out["per-operator"]["energy_per_token_j"], out["per-pool"]["energy_per_token_j"]
    out["per_operator_vs_per_pool"] = op / pool - 1.0
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--levels", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    rows = []
    print("| run | per-operator J/token | best | per-pool J/token | best | per-operator vs per-pool |")
    print("|---|---|---|---|---|---|")
    for name in [r for r in a.runs.split(",") if r]:
        row = compare(name, a.levels, a.workers)
        rows.append(row)
        op, pool = row["per-operator"], row["per-pool"]

        def cell(r: dict[str, Any]) -> str:
            return f"{r['energy_per_token_j']:.4f}{'' if r['feasible'] else ' (misses an SLO)'}"
        print(f"| {name} | {cell(op)} | {op['best']} | {cell(pool)} | {pool['best']} | "
              f"{100 * row['per_operator_vs_per_pool']:+.1f}% |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "levels": a.levels, "energy_source": "modelled"},
                                           indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

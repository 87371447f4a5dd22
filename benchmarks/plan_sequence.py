"""The live global scheduler's plans beside the simulator's, window by window, and energy per token each way.

Reads the live plans `tools.record_subject` recorded from `aflex.v1.telemetry.plan` during the replay
(kept from `--live-start` to `--live-end`, unix seconds), the live `aflex bench` JSON (telemetry energy,
tokens) and the `aflex sim` JSON (each policy's `plans`). A plan is compared by its kind, its pools'
shapes and how many workers it parks; window k is the live plan made k windows after the replay began
and the sim's plan at k × window_s. Energy per token is prompt + output tokens on both sides (the sim's
`energy_per_token_j`, cluster accounting; the live workers' telemetry energy over the same tokens).

    python benchmarks/plan_sequence.py --live out/bench/live-plans.jsonl --live-bench out/bench/live-conv.json \
        --sim out/bench/sim-conv.json --window-s 60 --live-start T0 --live-end T1 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def shape_of(plan: dict[str, Any]) -> tuple[str, tuple[tuple[str, tuple[int, ...]], ...], int]:
    pools = tuple(sorted((name, tuple(v)) for name, v in plan["pools"].items()))
    return plan["kind"], pools, int(plan["parked"])


def live_plans(path: Path, start: float, end: float) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if start <= rec["received_ts"] <= end:
            d = rec["data"]
            parked = sum(a.startswith("parked") for a in d["assignments"].values())
            out.append({"t_s": rec["received_ts"] - start, "kind": d["kind"], "pools": d["pools"], "parked": parked,
                        "load_rps": d["load_rps"]})
    return out


def sim_plans(sim: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"t_s": p["t_s"], "kind": p["kind"], "pools": {k: v for k, v in p.items() if k not in ("t_s", "kind",
                                                                                             "parked")},
             "parked": p["parked"]} for p in sim["plans"]]


def describe(plan: dict[str, Any] | None) -> str:
    return "-" if plan is None else f"{plan['kind']} {plan['pools']} parked {plan['parked']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--live", type=Path, required=True)
    parser.add_argument("--live-bench", type=Path, required=True)
    parser.add_argument("--sim", type=Path, required=True)
    parser.add_argument("--policy", default=None, help="the sim policy (default: the JSON's only one)")
    parser.add_argument("--window-s", type=float, required=True)
    parser.add_argument("--live-start", type=float, required=True)
    parser.add_argument("--live-end", type=float, required=True)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    sim_all = json.loads(args.sim.read_text())["policies"]
    policy = args.policy or next(iter(sim_all))
    sim = sim_all[policy]
    live = live_plans(args.live, args.live_start, args.live_end)
    # the plans the replay lived to see: the sim's last one, made as its clock reaches the end, has no live twin
    simulated = [p for p in sim_plans(sim) if p["t_s"] < args.live_end - args.live_start - args.window_s / 2]
    rows = []
    for k in range(max(len(live), len(simulated))):
        lp = live[k] if k < len(live) else None
        sp = simulated[k] if k < len(simulated) else None
        same = lp is not None and sp is not None and shape_of(lp) == shape_of(sp)
        rows.append({"window": k, "live": lp, "sim": sp, "same": same})
        print(f"window {k}: live {describe(lp):40s} sim {describe(sp):40s} {'same' if same else 'DIFFERENT'}")
    bench = json.loads(args.live_bench.read_text())
    tokens = bench["total_input_tokens"] + bench["total_output_tokens"]
    live_j = bench.get("telemetry_energy_j")
    live_per_token = live_j / tokens if live_j and tokens else None
    sim_per_token = sim["energy_per_token_j"]
    ratio = live_per_token / sim_per_token if live_per_token and sim_per_token else None
    print(f"energy per prompt+output token: live {live_per_token} J (telemetry, {tokens} tokens), sim {policy} "
          f"{sim_per_token} J (cluster, {sim['tokens']:.0f} tokens): live/sim {ratio}")
    print(f"plans: {sum(r['same'] for r in rows)} of {len(rows)} windows the same")
    if args.json is not None:
        args.json.write_text(json.dumps({"policy": policy, "window_s": args.window_s, "rows": rows,
                                         "live_energy_per_token_j": live_per_token,
                                         "sim_energy_per_token_j": sim_per_token, "live_over_sim": ratio,
                                         "live_tokens": tokens, "sim_tokens": sim["tokens"]}, indent=2))


if __name__ == "__main__":
    main()

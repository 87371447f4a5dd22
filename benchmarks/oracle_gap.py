"""Where AFlex's gap to `static-oracle` on conv-Qwen3 x1 goes: provisioning online or the clocks.

Replays of the Azure conv trace (16 modelled A800s, Qwen3-32B), all modelled energy, `cluster` accounting:
- AFlex as it runs (its elastic plans every 5 minutes);
- AFlex's own per-iteration clocks on the oracle's fixed shape (one TP8 whole-model replica, the other 8
  GPUs parked: the shape `static-oracle` picks, docs/evaluation.md);
- the oracle's fixed clocks (795 MHz prefill, 345 MHz decode) on that shape;
- AFlex with the `marginal` clock objective (prefill too scored above the idle floor), as it runs.

The first step against the second is what provisioning online costs, the second against the third what
AFlex's clocks cost: the oracle uses the P90 TTFT slack (364 ms of 400) that AFlex's per-iteration prefill
clocks leave (237 ms).

    python benchmarks/oracle_gap.py --json out/oracle_gap.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.sim.arrivals import load_trace
from loadgen.sim.engine import SimConfig, Simulation
from loadgen.sim.models import get_model
from loadgen.sim.policies import FixedPlan, PolicySpec, policy_spec
from shared.gpu.emulated import load_profile
from shared.perf import cached_predictor
from shared.policy import PoolShape

ORACLE_SHAPE = (("colocated", PoolShape(split=False, replicas=1, tp=8)),)
ORACLE_CLOCKS_MHZ = ((795.0, 795.0), (345.0, 345.0))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    profile, model = load_profile("a800"), get_model("qwen3-32b")
    pred, arrivals = cached_predictor(profile, model), load_trace("conv")
    aflex = policy_spec("aflex")
    fixed = replace(aflex, name="aflex-clocks-on-oracle-shape", placement="colocated", scaling=False,
                    fixed=FixedPlan(ORACLE_SHAPE))
    runs: dict[str, PolicySpec] = {
        "aflex": aflex,
        "aflex-clocks-on-oracle-shape": fixed,
        "oracle-clocks-on-oracle-shape": replace(fixed, name="oracle", clock=replace(aflex.clock,
                                                                                    fixed_mhz=ORACLE_CLOCKS_MHZ)),
        "aflex-marginal-objective": replace(aflex, clock=replace(aflex.clock, objective="marginal")),
    }
    configs = {name: SimConfig(gpus=16) for name in runs}
    out = {}
    for name, spec in runs.items():
        t0 = time.perf_counter()
        r = Simulation(profile, model, arrivals, spec, configs[name], pred).run()
        out[name] = {"energy_per_token_j": r["accounting"]["cluster"]["energy_per_token_j"],
                     "p90_ttft_ms": r["p90_ttft_ms"], "p90_tpot_ms": r["p90_tpot_ms"], "slo_met": r["slo_met"],
                     "mean_clock_mhz": r["mean_clock_mhz"], "wall_s": round(time.perf_counter() - t0, 1),
                     "energy_source": "modelled (emulated A800 profile)", "accounting": "cluster"}
        print(f"{name:32s} {out[name]['energy_per_token_j']:.4f} J/token  P90 TTFT {r['p90_ttft_ms']:.0f} ms  "
              f"P90 TPOT {r['p90_tpot_ms']:.0f} ms  clocks "
              + "/".join(f"{v:.0f}" for v in r["mean_clock_mhz"].values()), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

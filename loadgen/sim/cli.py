"""`aflex sim`: replay a trace against a modelled cluster for AFlex and the baselines.

The lead registers it in services/cli.py with `add_sim_arguments(parser)` and `sim(args)`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from loadgen.sim.arrivals import Arrivals, load_trace, synthetic
from loadgen.sim.engine import POLICIES, SimConfig, Simulation, policy_spec
from loadgen.sim.models import MODELS, get_model
from shared.gpu.emulated import available_profiles, load_profile
from shared.perf import cached_predictor


def _window(text: str) -> tuple[float, float]:
    try:
        a, b = text.split(":")
        return float(a), float(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window must be START:END seconds, got {text!r}") from None


def add_sim_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None, help="conv, code, or a CSV path (default: synthetic --rate)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply trace times (0.5 = twice the load)")
    p.add_argument("--window", type=_window, default=None, help="START:END seconds of the trace to replay")
    p.add_argument("--max-input-len", type=int, default=None, help="clip trace prompt lengths (as aflex bench)")
    p.add_argument("--max-output-len", type=int, default=None, help="clip trace output lengths (as aflex bench)")
    p.add_argument("--rate", type=float, default=4.0, help="synthetic arrivals per second (without --trace)")
    p.add_argument("--burstiness", type=float, default=1.0, help="synthetic inter-arrival CV (1 = Poisson)")
    p.add_argument("--duration", type=float, default=600.0, help="synthetic duration in seconds")
    p.add_argument("--gpu", default="a800", choices=available_profiles())
    p.add_argument("--model", default="qwen3-32b", choices=sorted(MODELS))
    p.add_argument("--gpus", type=int, default=16)
    p.add_argument("--policies", default="aflex,colocated-max,af-max,phase-dvfs",
                   help=f"comma-separated, from: {', '.join(POLICIES)}")
    p.add_argument("--ttft-slo-ms", type=float, default=400.0)
    p.add_argument("--tpot-slo-ms", type=float, default=120.0)
    p.add_argument("--link-gbs", type=float, default=400.0, help="A/F, TP and KV link bandwidth, GB/s")
    p.add_argument("--switch-delay-ms", type=float, default=None, help="clock-switch delay (default: profile's)")
    p.add_argument("--window-s", type=float, default=300.0, help="provisioning window")
    p.add_argument("--parked-power", choices=["context", "idle"], default="context",
                   help="power of GPUs left out of the plan: context-idle (warm) or idle (no context)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--plots", default=None, help="directory for PNG plots")


def _arrivals(args: argparse.Namespace) -> Arrivals:
    if args.trace:
        return load_trace(args.trace, time_scale=args.time_scale, window=args.window,
                          max_input_len=getattr(args, "max_input_len", None),
                          max_output_len=getattr(args, "max_output_len", None))
    return synthetic(args.rate, args.duration, args.seed, args.burstiness)


def run_policies(args: argparse.Namespace, record: bool = False) -> dict[str, Any]:
    profile = load_profile(args.gpu)
    model = get_model(args.model)
    arrivals = _arrivals(args)
    pred = cached_predictor(profile, model)
    out: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("func",) and not callable(v)},
        "profile": profile.name, "requests": len(arrivals), "policies": {}, "timelines": {},
    }
    for name in [s.strip() for s in args.policies.split(",") if s.strip()]:
        cfg = SimConfig(gpus=args.gpus, ttft_slo_s=args.ttft_slo_ms / 1e3, tpot_slo_s=args.tpot_slo_ms / 1e3,
                        link_bytes_s=args.link_gbs * 1e9,
                        switch_delay_s=None if args.switch_delay_ms is None else args.switch_delay_ms / 1e3,
                        window_s=args.window_s, parked_power=args.parked_power, record_power=record, seed=args.seed)
        t0 = time.perf_counter()
        simulation = Simulation(profile, model, arrivals, policy_spec(name), cfg, pred)
        res = simulation.run()
        res["wall_s"] = round(time.perf_counter() - t0, 2)
        out["policies"][name] = res
        if record:
            out["timelines"][name] = {"clocks": simulation.clock_trace, "power": simulation.timeline}
        print(f"{name:24s} E/token {res['energy_per_token_j']:.3f} J  P90 TTFT {res['p90_ttft_ms']:.0f} ms  "
              f"P90 TPOT {res['p90_tpot_ms']:.0f} ms  SLO {res['slo_attainment']:.3f}  ({res['wall_s']} s)",
              file=sys.stderr)
    return out


def sim(args: argparse.Namespace) -> int:
    out = run_policies(args, record=bool(args.plots))
    timelines = out.pop("timelines")
    if args.plots:
        from loadgen.sim.plots import write_plots

        write_plots(Path(args.plots), out, timelines, args)
    text = json.dumps(out, indent=2, default=str)
    if args.json:
        Path(args.json).write_text(text + "\n")
    else:
        print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aflex sim", description=__doc__)
    add_sim_arguments(parser)
    return sim(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

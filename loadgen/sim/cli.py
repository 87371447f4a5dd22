"""`aflex sim`: replay a trace against a modelled cluster for AFlex and the baselines.

Registered in services/launcher/cli.py with `add_sim_arguments(parser)` and `sim(args)`. `--load` runs a
sweep (the trace's arrival rate scaled by each factor); every policy's figures come in the cluster and
active accountings (fixed-pool on request). The accounting asked for is also the deployment the scaling
planners plan for (`config.planner_parked_w`).
`static-oracle` and `pool-oracle` run their grid searches first (loadgen.sim.oracle) and report the best
configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from loadgen.sim.arrivals import Arrivals, load_trace, long_context, synthetic
from loadgen.sim.engine import ACCOUNTINGS, SimConfig, Simulation
from loadgen.sim.models import MODELS, get_model
from loadgen.sim.policies import ORACLES, PAPER_POLICIES, policy_spec
from loadgen.workloads import WorkloadError
from shared.gpu.base import GPUError
from shared.gpu.emulated import GPUProfile, available_profiles, load_profile
from shared.kinds import PARKING_CHOICES
from shared.perf import cached_predictor


def _window(text: str) -> tuple[float, float]:
    try:
        a, b = text.split(":")
        return float(a), float(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window must be START:END seconds, got {text!r}") from None


def _levels(text: str) -> int:
    try:
        levels = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--oracle-levels must be a whole number, got {text!r}") from None
    if levels < 2:
        raise argparse.ArgumentTypeError(f"--oracle-levels must be at least 2 (a grid), got {text!r}")
    return levels


PLOT_LOADS = (0.25, 0.5, 1.0, 2.0)  # the energy-against-load plot's loads when no --load was given


def _loads(text: str) -> tuple[float, ...]:
    try:
        loads = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--load must be comma-separated numbers, got {text!r}") from None
    if not loads or any(x <= 0 for x in loads):
        raise argparse.ArgumentTypeError(f"--load multipliers must be > 0, got {text!r}")
    return loads


def add_sim_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None,
                   help="conv, code, a CSV path, or long-context (synthetic 8-32K-token prompts at --rate); "
                        "default: synthetic --rate")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply trace times (0.5 = twice the load)")
    p.add_argument("--load", type=_loads, default=None,
                   help="comma-separated arrival-rate multipliers for a sweep, e.g. 0.25,0.5,1,2")
    p.add_argument("--window", type=_window, default=None, help="START:END seconds of the trace to replay")
    p.add_argument("--max-input-len", type=int, default=None, help="clip trace prompt lengths (as aflex bench)")
    p.add_argument("--max-output-len", type=int, default=None, help="clip trace output lengths (as aflex bench)")
    p.add_argument("--rate", type=float, default=4.0, help="synthetic arrivals per second (without --trace)")
    p.add_argument("--burstiness", type=float, default=1.0, help="synthetic inter-arrival CV (1 = Poisson)")
    p.add_argument("--duration", type=float, default=600.0, help="synthetic duration in seconds")
    p.add_argument("--prompt-mean", type=float, default=1024.0, help="synthetic mean prompt tokens (lognormal)")
    p.add_argument("--output-mean", type=float, default=256.0, help="synthetic mean output tokens (lognormal)")
    p.add_argument("--prefix-reuse", type=float, default=None,
                   help="share of prompt tokens found in a prefix cache (0-1; multi-turn chat ~0.5-0.8); only the "
                        "rest is prefilled and charged")
    p.add_argument("--gpu", default="a800", choices=available_profiles())
    p.add_argument("--model", default="qwen3-32b", choices=sorted(MODELS))
    p.add_argument("--gpus", type=int, default=16)
    p.add_argument("--policies", default="aflex,sglang,distserve,dynamollm,biscale",
                   help=f"comma-separated, from: {', '.join(PAPER_POLICIES)} (colocated-max = sglang)")
    p.add_argument("--ttft-slo-ms", type=float, default=400.0)
    p.add_argument("--tpot-slo-ms", type=float, default=120.0)
    p.add_argument("--link-gbs", type=float, default=400.0, help="A/F, TP and KV link bandwidth in a node, GB/s")
    p.add_argument("--node-gpus", type=int, default=8, help="GPUs per node (0: every GPU on one --link-gbs fabric)")
    p.add_argument("--inter-node-gbs", type=float, default=25.0,
                   help="what one GPU moves to another node, GB/s (a 200 Gb/s HDR NIC per GPU)")
    p.add_argument("--switch-delay-ms", type=float, default=None, help="clock-switch delay (default: profile's)")
    p.add_argument("--window-s", type=float, default=300.0, help="provisioning window")
    p.add_argument("--parking", choices=list(PARKING_CHOICES), default="auto",
                   help="where GPUs outside a scaling policy's plan wait: warm (context kept, lowest clock), "
                        "cold (context released, bare idle; rejoin after a model load), auto (break-even)")
    p.add_argument("--accounting", choices=list(ACCOUNTINGS), default="cluster",
                   help="the deployment and which accounting the summary lines print (the JSON has cluster "
                        "and active): active prices a parked GPU at 0 W in every scaling planner (it is handed "
                        "back); fixed-pool (the paper's: every GPU charged all run, none parked cold) forces "
                        "warm parking")
    p.add_argument("--idle-clock-share", type=float, default=None,
                   help="share of context-idle power that follows f*V^2 (default: the profile's; a modelling choice)")
    p.add_argument("--oracle-workers", type=int, default=2, help="processes for the oracles' grid replays")
    p.add_argument("--oracle-levels", type=_levels, default=4, help="clock levels per operator in the oracles' grids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--plots", default=None, help="directory for PNG plots")


def _arrivals(args: argparse.Namespace) -> Arrivals:
    if args.trace == "long-context":  # synthetic, at --rate for --duration (loadgen.sim.arrivals.long_context)
        return long_context(args.rate / args.time_scale, args.duration, args.seed, args.burstiness)
    if args.trace:
        return load_trace(args.trace, time_scale=args.time_scale, window=args.window,
                          max_input_len=getattr(args, "max_input_len", None),
                          max_output_len=getattr(args, "max_output_len", None))
    return synthetic(args.rate, args.duration, args.seed, args.burstiness,
                     prompt_mean=getattr(args, "prompt_mean", 1024.0), output_mean=getattr(args, "output_mean", 256.0))


def sim_config(args: argparse.Namespace, record: bool = False) -> SimConfig:
    return SimConfig(gpus=args.gpus, ttft_slo_s=args.ttft_slo_ms / 1e3, tpot_slo_s=args.tpot_slo_ms / 1e3,
                     link_bytes_s=args.link_gbs * 1e9, node_gpus=getattr(args, "node_gpus", 8),
                     inter_node_bytes_s=getattr(args, "inter_node_gbs", 25.0) * 1e9,
                     switch_delay_s=None if args.switch_delay_ms is None else args.switch_delay_ms / 1e3,
                     window_s=args.window_s, parking=args.parking, accounting=args.accounting, record_power=record,
                     seed=args.seed, prefix_reuse=getattr(args, "prefix_reuse", None))


def sim_profile(args: argparse.Namespace) -> GPUProfile:
    profile = load_profile(args.gpu)
    share = getattr(args, "idle_clock_share", None)
    return profile if share is None else profile.with_idle_clock_share(share)


def _summary(name: str, res: dict[str, Any], accounting: str) -> str:
    acc = res["accounting"][accounting]
    return (f"{name:24s} {accounting} E/token {acc['energy_per_token_j']:.3f} J  P90 TTFT {res['p90_ttft_ms']:.0f} ms  "
            f"P90 TPOT {res['p90_tpot_ms']:.0f} ms  SLO {res['slo_attainment']:.3f}  ({res['wall_s']} s)")


def run_policies(args: argparse.Namespace, record: bool = False) -> dict[str, Any]:
    """Every policy of `args.policies` on one trace at one load; the JSON's `policies` section."""
    profile = sim_profile(args)
    model = get_model(args.model)
    arrivals = _arrivals(args)
    pred = cached_predictor(profile, model)
    out: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("func",) and not callable(v)},
        "profile": profile.name, "requests": len(arrivals), "policies": {}, "timelines": {},
        "energy_source": "modelled (emulated GPU profile); not measured",
    }
    for name in [s.strip() for s in args.policies.split(",") if s.strip()]:
        cfg = sim_config(args, record)
        t0 = time.perf_counter()
        simulation: Simulation | None = None
        if name in ORACLES:
            from loadgen.sim.oracle import search_oracle, search_pool_oracle

            search = search_pool_oracle if name == "pool-oracle" else search_oracle
            oracle = search(profile, model, arrivals, cfg, workers=args.oracle_workers, levels=args.oracle_levels)
            res = oracle.result
            simulation = oracle.rerun(profile, model, arrivals, cfg, pred) if record else None
        else:
            simulation = Simulation(profile, model, arrivals, policy_spec(name), cfg, pred)
            res = simulation.run()
        res["wall_s"] = round(time.perf_counter() - t0, 2)
        out["policies"][name] = res
        if record and simulation is not None:
            out["timelines"][name] = {"clocks": simulation.clock_trace, "power": simulation.ledger.timeline,
                                      "plans": res["plans"]}
        print(_summary(name, res, args.accounting), file=sys.stderr)
    return out


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """`sweep[load][policy]`: each load multiplier scales the arrival rate (time scale / load)."""
    sweep: dict[str, Any] = {}
    for load in args.load:
        a = argparse.Namespace(**vars(args))
        a.time_scale = args.time_scale / load
        if not args.trace:
            a.rate = args.rate * load
        print(f"-- load x{load:g}", file=sys.stderr)
        sweep[f"{load:g}"] = run_policies(a)["policies"]
    return sweep


def sim(args: argparse.Namespace) -> int:
    try:
        out = run_policies(args, record=bool(args.plots))
        if args.load:
            out["sweep"] = run_sweep(args)
    except (ValueError, FileNotFoundError, GPUError, WorkloadError) as exc:
        print(f"aflex sim: {exc}", file=sys.stderr)
        return 2
    timelines = out.pop("timelines")
    if args.plots:
        from loadgen.sim.plots import write_plots

        sweep = out.get("sweep") or run_sweep(argparse.Namespace(**{**vars(args), "load": PLOT_LOADS}))
        write_plots(Path(args.plots), timelines, sweep)
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

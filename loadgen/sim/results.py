"""A finished simulation's figures: latency percentiles, SLO attainment, clocks and energy in both accountings.

Energy per token is GPU energy / (prompt + output tokens) (AFlex's metric); energy per output token is
ML.ENERGY's. Both are given under `cluster` and `active` accounting (ledger.py); the top-level
`energy_j` / `energy_per_token_j` are the accounting the run was asked for (`SimConfig.accounting`).
Every figure here is modelled (the emulated GPU profile), never measured.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from loadgen.sim.arrivals import Arrivals
    from loadgen.sim.config import SimConfig
    from loadgen.sim.fleet import Pool
    from loadgen.sim.ledger import EnergyLedger
    from loadgen.sim.planning import SimPlanner
    from shared.kinds import ParkedState
    from shared.policy import SloMargin


class FinishedRun(Protocol):
    """What a finished `Simulation` holds that its figures are read from (so this module needs no engine)."""

    arr: Arrivals
    cfg: SimConfig
    ledger: EnergyLedger
    first: np.ndarray  # per request: first token time (s), NaN if none
    finish: np.ndarray  # per request: finish time (s), NaN if unfinished
    makespan: float
    clock_time: dict[str, float]  # GPU-seconds busy per operator
    clock_weighted: dict[str, float]  # the same weighted by clock (MHz·s)
    pools: dict[str, Pool]
    parking: ParkedState
    rejoins: list[tuple[float, int, str, float]]
    reshards: list[tuple[float, int, float]]
    planner: SimPlanner
    plans: list[tuple[float, dict[str, Any]]]
    margin_ttft: SloMargin
    margin_tpot: SloMargin


def energy_figures(energy_j: float, gpu_s: float, span_s: float, prompt_tokens: float,
                   output_tokens: float) -> dict[str, float | None]:
    tokens = prompt_tokens + output_tokens
    return {
        "energy_j": energy_j,
        "energy_per_token_j": energy_j / tokens if tokens else None,
        "energy_per_output_token_j": energy_j / output_tokens if output_tokens else None,
        "mean_power_w": energy_j / span_s if span_s > 0 else None,
        "gpu_s": gpu_s,
    }


def sim_results(sim: FinishedRun) -> dict[str, Any]:
    a, cfg, led = sim.arr, sim.cfg, sim.ledger
    ttft = (sim.first - a.time_s) * 1e3
    multi = a.output > 1
    tpot = np.where(multi, (sim.finish - sim.first) / np.maximum(a.output - 1, 1) * 1e3, 0.0)
    prompt_tokens, output_tokens = float(a.prompt.sum()), float(a.output.sum())
    ok = (ttft <= cfg.ttft_slo_s * 1e3) & (tpot <= cfg.tpot_slo_s * 1e3)

    def pct(x: np.ndarray, q: float) -> float | None:
        return float(np.percentile(x, q)) if len(x) else None

    accounting = {
        "cluster": energy_figures(led.cluster_j, led.cluster_gpu_s, sim.makespan, prompt_tokens, output_tokens),
        "active": energy_figures(led.active_j, led.active_gpu_s, sim.makespan - led.active_from_s, prompt_tokens,
                                 output_tokens),
    }
    if cfg.accounting == "fixed-pool":  # a warm-parked run: every GPU charged start to end at its clock's idle
        accounting["fixed-pool"] = accounting["cluster"]
    chosen = accounting[cfg.accounting]
    return {
        "requests": len(a),
        "finished": int(np.sum(~np.isnan(sim.finish))),
        "tokens": prompt_tokens + output_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        # prompt tokens served from a prefix cache: counted in `tokens`, never prefilled nor charged
        "cached_tokens": float(a.cached.sum()) if a.cached is not None else 0.0,
        "accounting_reported": cfg.accounting,
        "energy_j": chosen["energy_j"],
        "energy_per_token_j": chosen["energy_per_token_j"],
        "energy_per_output_token_j": chosen["energy_per_output_token_j"],
        "mean_power_w": chosen["mean_power_w"],
        "accounting": accounting,
        "energy_source": "modelled (emulated GPU profile)",
        "makespan_s": sim.makespan,
        "p50_ttft_ms": pct(ttft, 50), "p90_ttft_ms": pct(ttft, 90), "p99_ttft_ms": pct(ttft, 99),
        "p50_tpot_ms": pct(tpot[multi], 50), "p90_tpot_ms": pct(tpot[multi], 90),
        "p99_tpot_ms": pct(tpot[multi], 99),
        "slo_attainment": float(np.mean(ok)) if len(a) else None,
        "slo_met": bool(len(a) and (pct(ttft, 90) or 0) <= cfg.ttft_slo_s * 1e3
                        and (pct(tpot[multi], 90) or 0) <= cfg.tpot_slo_s * 1e3),
        "mean_clock_mhz": {k: (sim.clock_weighted[k] / sim.clock_time[k] if sim.clock_time[k] else None)
                           for k in sim.clock_time},
        "gpus": cfg.gpus,
        "pool_energy_j": pool_energy_by_mode(sim.pools.values()),
        "parking": sim.parking,
        "parked_j": led.parked_j,
        "parked_gpu_s": led.parked_gpu_s,
        "rejoin_j": led.rejoin_j,
        "rejoins": [{"t_s": t, "gpus": k, "from": kind, "delay_s": d} for t, k, kind, d in sim.rejoins],
        "reshards": [{"t_s": t, "gpus": k, "stall_s": d} for t, k, d in sim.reshards],
        "placement": sim.planner.placement_note,
        "plans": [{"t_s": t, **p} for t, p in sim.plans],
        # AFlex: each plan kind's predicted power × this = what its plans drew (at the end of the run)
        "power_factor": (sim.planner.correction.factors(sim.planner.policy.kinds)
                         if sim.planner.correction is not None else None),
        "final_margin": {"ttft": sim.margin_ttft.margin, "tpot": sim.margin_tpot.margin},
    }


def pool_energy_by_mode(pools: Iterable[Pool]) -> dict[str, float]:
    """Each plan pool's energy (J), a colocated plan's replicas summed into one figure."""
    out: dict[str, float] = {}
    for pool in pools:
        out[pool.mode] = out.get(pool.mode, 0.0) + pool.energy_j
    return out

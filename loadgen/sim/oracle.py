"""`static-oracle`: the best fixed AFlex configuration for a trace, chosen in hindsight by replaying a grid.

A configuration is AFlex's pipeline (A/F split prefill and decode pools, its batching and depth choice)
with everything the controllers would otherwise change held fixed for the whole trace: the pool shapes
and four clocks (prefill attention, prefill FFN, decode attention, decode FFN). The grid:

- shapes: AFlex's own provisioner run once on the trace's busiest 5-minute window at each of
  `HEADROOMS` (hindsight: it sees the whole trace), distinct plans only;
- clocks: `levels` per operator, prefill levels from the knee to the top and decode levels around the
  bandwidth-saturation clock (`clock_levels`).

The search uses that the two pools do not share GPUs or SLOs: the prefill pool's energy and the TTFT
depend only on the prefill clocks, the decode pool's energy and the TPOT only on the decode clocks
(decode arrivals move a little with prefill clocks). So replay k runs prefill combination k beside
decode combination k, and `levels²` replays per shape cover both full grids; the best prefill
combinations (the `top_k` with the least prefill-pool energy and P90 TTFT inside the SLO) and the best
decode combinations (least energy outside the prefill pool, P90 TPOT inside) are then replayed together (the run's
length still couples them a little: slower decode keeps every GPU a little longer), and the
least-energy configuration that meets both SLOs wins. Cost: shapes × (levels² + top_k²) whole-trace
replays, spread over `workers` processes. `exhaustive=True` replays every joint combination instead (levels⁴ per shape:
the tests check the two agree on a small case).
"""

from __future__ import annotations

import itertools
import multiprocessing
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from loadgen.sim.arrivals import Arrivals
from loadgen.sim.engine import SimConfig, Simulation
from loadgen.sim.planning import SimPlanner
from loadgen.sim.policies import FixedPlan, PolicySpec, policy_spec
from shared.gpu.emulated import GPUProfile
from shared.model.config import ModelArgs
from shared.perf import Predictor, cached_predictor
from shared.policy import PoolShape, provision

HEADROOMS = (1.0, 1.5, 2.0)
Clocks = tuple[tuple[float, float], tuple[float, float]]


@dataclass(frozen=True)
class OracleConfig:
    prefill: PoolShape
    decode: PoolShape
    clocks_mhz: Clocks  # ((prefill attention, prefill FFN), (decode attention, decode FFN))

    def spec(self) -> PolicySpec:
        base = policy_spec("aflex")
        return replace(base, name="static-oracle", scaling=False, fixed=FixedPlan(
            (("prefill", self.prefill), ("decode", self.decode))),
            clock=replace(base.clock, fixed_mhz=self.clocks_mhz))

    def describe(self) -> dict[str, Any]:
        (pa, pf), (da, df) = self.clocks_mhz
        return {"prefill": [self.prefill.attention, self.prefill.ffn, self.prefill.attention_tp],
                "decode": [self.decode.attention, self.decode.ffn, self.decode.attention_tp],
                "clocks_mhz": {"PA": pa, "PF": pf, "DA": da, "DF": df}}


@dataclass
class OracleResult:
    best: OracleConfig
    result: dict[str, Any]
    replays: list[dict[str, Any]] = field(default_factory=list)

    def rerun(self, profile: GPUProfile, model: ModelArgs, arrivals: Arrivals, cfg: SimConfig,
              pred: Predictor) -> Simulation:
        """The winning configuration replayed once more (for its timelines; same figures: deterministic)."""
        sim = Simulation(profile, model, arrivals, self.best.spec(), cfg, pred)
        sim.run()
        return sim


def snap_to_table(clocks_mhz: Iterable[float], table_mhz: np.ndarray) -> list[float]:
    """Each clock moved to the nearest of the predictor's table (what a fixed rule can pin), deduplicated."""
    return list(dict.fromkeys(float(table_mhz[int(np.argmin(np.abs(table_mhz - f)))]) for f in clocks_mhz))


def clock_levels(profile: GPUProfile, levels: int, table_mhz: np.ndarray) -> tuple[list[float], list[float]]:
    """(prefill levels, decode levels) on the predictor's clock table: prefill from the voltage knee's
    neighbourhood to the top clock, decode around the bandwidth-saturation clock."""
    pre = np.linspace(0.55 * profile.max_mhz, profile.max_mhz, levels)
    sat = profile.bandwidth_saturation_mhz
    dec = np.linspace(0.6 * sat, 1.45 * sat, levels)
    return snap_to_table(pre, table_mhz), snap_to_table(dec, table_mhz)


def oracle_shapes(pred: Predictor, planner: SimPlanner, headrooms: Sequence[float] = HEADROOMS,
                  ) -> list[tuple[PoolShape, PoolShape]]:
    peak = planner.peak_load()
    rule = policy_spec("aflex").clock
    out: list[tuple[PoolShape, PoolShape]] = []
    for h in headrooms:
        plan = provision(pred, peak, planner.spec, rule, headroom=h)
        if plan.prefill is not None and plan.decode is not None and (plan.prefill, plan.decode) not in out:
            out.append((plan.prefill, plan.decode))
    return out


def _replay(job: tuple[GPUProfile, ModelArgs, Arrivals, SimConfig, OracleConfig]) -> dict[str, Any]:
    profile, model, arrivals, cfg, conf = job
    res = Simulation(profile, model, arrivals, conf.spec(), cfg, cached_predictor(profile, model)).run()
    return {"config": conf, "result": res}


def _meets(res: dict[str, Any], cfg: SimConfig, which: str) -> bool:
    if which == "ttft":
        return (res["p90_ttft_ms"] or 0.0) <= cfg.ttft_slo_s * 1e3
    return (res["p90_tpot_ms"] or 0.0) <= cfg.tpot_slo_s * 1e3


def _run_all(jobs: list[tuple[Any, ...]], workers: int) -> list[dict[str, Any]]:
    if workers <= 1 or len(jobs) <= 1:
        return [_replay(j) for j in jobs]  # type: ignore[arg-type]
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork")) as ex:
        return list(ex.map(_replay, jobs))


def search_oracle(profile: GPUProfile, model: ModelArgs, arrivals: Arrivals, cfg: SimConfig, workers: int = 2,
                  levels: int = 4, shapes: Sequence[tuple[PoolShape, PoolShape]] | None = None,
                  levels_mhz: tuple[Sequence[float], Sequence[float]] | None = None,
                  exhaustive: bool = False, top_k: int = 3) -> OracleResult:
    """The least-energy fixed configuration that meets both SLOs over the whole trace (module docstring)."""
    pred = cached_predictor(profile, model)
    probe = Simulation(profile, model, arrivals, policy_spec("aflex"), cfg, pred)
    shapes = list(shapes) if shapes is not None else oracle_shapes(pred, probe.planner)
    if levels_mhz is None:
        pre_levels, dec_levels = clock_levels(profile, levels, pred.clocks)
    else:
        pre_levels, dec_levels = snap_to_table(levels_mhz[0], pred.clocks), snap_to_table(levels_mhz[1], pred.clocks)
    pre_grid = list(itertools.product(pre_levels, pre_levels))
    dec_grid = list(itertools.product(dec_levels, dec_levels))
    configs: list[OracleConfig] = []
    for ps, ds in shapes:
        if exhaustive:
            configs += [OracleConfig(ps, ds, (p, d)) for p in pre_grid for d in dec_grid]
        else:
            n = max(len(pre_grid), len(dec_grid))  # the shorter grid cycles
            configs += [OracleConfig(ps, ds, (pre_grid[k % len(pre_grid)], dec_grid[k % len(dec_grid)]))
                        for k in range(n)]
    runs = _run_all([(profile, model, arrivals, cfg, c) for c in configs], workers)
    if not exhaustive:
        finals = []
        for ps, ds in shapes:
            mine = [r for r in runs if (r["config"].prefill, r["config"].decode) == (ps, ds)]
            ok_p = sorted((r for r in mine if _meets(r["result"], cfg, "ttft")),
                          key=lambda r: r["result"]["pool_energy_j"]["prefill"])
            # a decode choice also sets how long the run lasts, so it is scored with everything but the
            # prefill pool (decode pool, parked GPUs)
            ok_d = sorted((r for r in mine if _meets(r["result"], cfg, "tpot")),
                          key=lambda r: r["result"]["energy_j"] - r["result"]["pool_energy_j"]["prefill"])
            best_p = list(dict.fromkeys(r["config"].clocks_mhz[0] for r in ok_p))[:top_k]
            best_d = list(dict.fromkeys(r["config"].clocks_mhz[1] for r in ok_d))[:top_k]
            tried = {r["config"].clocks_mhz for r in mine}
            finals += [OracleConfig(ps, ds, (bp, bd)) for bp in best_p for bd in best_d if (bp, bd) not in tried]
        runs += _run_all([(profile, model, arrivals, cfg, c) for c in finals], workers)
    feasible = [r for r in runs if _meets(r["result"], cfg, "ttft") and _meets(r["result"], cfg, "tpot")]
    table = [{**r["config"].describe(), "energy_j": r["result"]["energy_j"],
              "p90_ttft_ms": r["result"]["p90_ttft_ms"], "p90_tpot_ms": r["result"]["p90_tpot_ms"]} for r in runs]
    if feasible:
        best = min(feasible, key=lambda r: r["result"]["energy_j"])
    else:  # nothing meets both SLOs: report the configuration closest to them
        best = max(runs, key=lambda r: r["result"]["slo_attainment"] or 0.0)
    res = dict(best["result"])
    res["oracle"] = {"feasible": bool(feasible), "replays": len(runs), "shapes": len(shapes),
                     "levels_mhz": [list(pre_levels), list(dec_levels)], "best": best["config"].describe(),
                     "grid": table}
    return OracleResult(best["config"], res, table)

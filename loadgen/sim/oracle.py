"""`static-oracle`: the best fixed AFlex configuration for a trace, chosen in hindsight by replaying a grid;
`pool-oracle`: the same search over instance pools (P/D or colocated) at one clock per pool and phase.

A configuration is AFlex's pipeline with the pool shapes and four clocks (prefill/decode × attention/
FFN) held for the whole trace; shapes from AFlex's provisioners on the busiest window at each of
`HEADROOMS`, every kind its footprint may take (split P/D pools; colocated replicas, whose two halves
share a clock), clocks at `levels` per operator (`clock_levels`). The two pools share neither GPUs nor
SLOs, so one replay screens a prefill and a decode combination side by side, and only the `top_k`
best of each are paired and replayed whole. A colocated shape runs both phases in one pool, so its
clocks are searched by coordinates instead: prefill levels at one decode level, then decode levels at the
best prefill (`_colocated_finals`). `exhaustive=True` replays every joint combination (the tests check
the searches agree on small cases). The search in full: docs/evaluation.md, "static-oracle".
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
from shared.gpu.snap import snap_clock
from shared.model.config import ModelArgs
from shared.perf import Predictor, cached_predictor
from shared.policy import PoolShape, provision
from shared.policy.baseline_placement import provision_pd
from shared.policy.colocated import provision_colocated
from shared.policy.footprint import AFLEX_KINDS

HEADROOMS = (1.0, 1.5, 2.0)
Clocks = tuple[tuple[float, float], tuple[float, float]]


@dataclass(frozen=True)
class OracleConfig:
    """Pool shapes and fixed clocks held for a whole trace: AFlex's split P/D pools (`static-oracle`), or
    instance pools, P/D or one colocated pool in `prefill`, at one clock per pool and phase (`pool-oracle`)."""

    prefill: PoolShape
    decode: PoolShape | None  # None: `prefill` is one colocated pool serving both phases
    clocks_mhz: Clocks  # ((prefill attention, prefill FFN), (decode attention, decode FFN))
    name: str = "static-oracle"

    def spec(self) -> PolicySpec:
        base = policy_spec("aflex")
        pools = (("prefill", self.prefill), ("decode", self.decode)) if self.decode is not None else (
            ("colocated", self.prefill),)
        clock = replace(base.clock, fixed_mhz=self.clocks_mhz)
        placement = base.placement if self.prefill.split else "pd" if self.decode is not None else "colocated"
        return replace(base, name=self.name, placement=placement, scaling=False, fixed=FixedPlan(pools), clock=clock)

    def describe(self) -> dict[str, Any]:
        (pa, pf), (da, df) = self.clocks_mhz

        def shape(s: PoolShape) -> list[int]:
            return [s.attention, s.ffn, s.attention_tp] if s.split else [s.replicas, s.tp]
        pools = {"prefill": shape(self.prefill), "decode": shape(self.decode)} if self.decode is not None else {
            "colocated": shape(self.prefill)}
        return pools | {"clocks_mhz": {"PA": pa, "PF": pf, "DA": da, "DF": df}}


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
    table = [float(f) for f in table_mhz]
    return list(dict.fromkeys(snap_clock(table, f, "nearest") for f in clocks_mhz))


def clock_levels(profile: GPUProfile, levels: int, table_mhz: np.ndarray) -> tuple[list[float], list[float]]:
    """(prefill levels, decode levels) on the predictor's clock table: prefill from the voltage knee's
    neighbourhood to the top clock, decode around the bandwidth-saturation clock."""
    pre = np.linspace(0.55 * profile.max_mhz, profile.max_mhz, levels)
    sat = profile.bandwidth_saturation_mhz
    dec = np.linspace(0.6 * sat, 1.45 * sat, levels)
    return snap_to_table(pre, table_mhz), snap_to_table(dec, table_mhz)


def oracle_shapes(pred: Predictor, planner: SimPlanner, headrooms: Sequence[float] = HEADROOMS,
                  ) -> list[tuple[PoolShape, PoolShape | None]]:
    """`static-oracle`'s shapes: AFlex's split P/D pools and its colocated replicas (decode None: one pool, both
    phases) for the busiest window at each headroom. Its P/D pools of replicas ("pd-colocated") are
    `pool-oracle`'s shapes, searched there at a clock per pool: the two oracles together hold every kind
    in `AFLEX_KINDS`, and a cell's hindsight bound is the lower of them."""
    peak = planner.peak_load()
    rule = policy_spec("aflex").clock
    out: list[tuple[PoolShape, PoolShape | None]] = []
    for h in headrooms:
        plan = provision(pred, peak, planner.spec, rule, headroom=h)
        if plan.prefill is not None and plan.decode is not None and (plan.prefill, plan.decode) not in out:
            out.append((plan.prefill, plan.decode))
    if "colocated" in AFLEX_KINDS:
        for h in headrooms:
            colocated = provision_colocated(pred, peak, planner.spec, rule, h).mixed
            if colocated is not None and (colocated, None) not in out:
                out.append((colocated, None))
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


def _rest_j(run: dict[str, Any]) -> float:
    """A replay's energy outside its prefill pool (decode pool, parked GPUs)."""
    return float(run["result"]["energy_j"] - run["result"]["pool_energy_j"]["prefill"])


def _pool_idle_w(profile: GPUProfile, shape: PoolShape, clocks_mhz: tuple[float, float]) -> float:
    """What a pool's GPUs draw waiting at fixed clocks (attention, FFN)."""
    fa, ff = clocks_mhz
    if shape.split:
        return shape.attention * profile.context_idle_power_at(fa) + shape.ffn * profile.context_idle_power_at(ff)
    return shape.gpus * profile.context_idle_power_at(fa)


def prefill_screen_j(profile: GPUProfile, run: dict[str, Any], horizon_s: float) -> float:
    """A screening replay's prefill-pool energy to a common horizon: a slow decode choice in the same replay
    stretches the run, and the prefill pool's idle tail with it, which says nothing about the prefill clocks."""
    conf: OracleConfig = run["config"]
    tail_s = run["result"]["makespan_s"] - horizon_s
    return float(run["result"]["pool_energy_j"]["prefill"] - _pool_idle_w(profile, conf.prefill, conf.clocks_mhz[0])
                 * tail_s)


def _finals(profile: GPUProfile, runs: list[dict[str, Any]], shapes: Sequence[tuple[PoolShape, PoolShape]],
            cfg: SimConfig, top_k: int, slack: float = 0.01, name: str = "static-oracle") -> list[OracleConfig]:
    """The joint replays after the screening. Per shape, its `top_k` prefill clock pairs (least prefill-pool
    energy, P90 TTFT inside the SLO) are paired with its `top_k` decode pairs (least energy outside the
    prefill pool -- a decode choice also sets how long the run lasts -- P90 TPOT inside); a pair is
    replayed when its screened estimate (the one's prefill-pool energy plus the other's rest) is within
    `slack` of the least estimate over all shapes, and it was not screened already."""
    cands: list[tuple[float, OracleConfig]] = []
    for ps, ds in shapes:
        mine = [r for r in runs if (r["config"].prefill, r["config"].decode) == (ps, ds)]
        if not mine:
            continue
        horizon_s = min(r["result"]["makespan_s"] for r in mine)
        pre: dict[tuple[float, float], float] = {}
        for r in sorted(mine, key=lambda r: prefill_screen_j(profile, r, horizon_s)):
            if _meets(r["result"], cfg, "ttft"):
                pre.setdefault(r["config"].clocks_mhz[0], prefill_screen_j(profile, r, horizon_s))
        rest: dict[tuple[float, float], float] = {}
        for r in sorted(mine, key=_rest_j):
            if _meets(r["result"], cfg, "tpot"):
                rest.setdefault(r["config"].clocks_mhz[1], _rest_j(r))
        tried = {r["config"].clocks_mhz for r in mine}
        cands += [(e_p + e_r, OracleConfig(ps, ds, (bp, bd), name)) for bp, e_p in list(pre.items())[:top_k]
                  for bd, e_r in list(rest.items())[:top_k] if (bp, bd) not in tried]
    if not cands:
        return []
    least = min(est for est, _ in cands)
    return [c for est, c in cands if est <= least * (1.0 + slack)]


def _colocated_finals(runs: list[dict[str, Any]], shape: PoolShape, dec_pairs: list[tuple[float, float]],
                      cfg: SimConfig) -> list[OracleConfig]:
    """A colocated shape's second coordinate: its prefill and decode clocks share the pool, so they are not
    screened apart; the first round held decode at the level nearest the bandwidth-saturation clock and
    swept prefill, this one sweeps decode at the best prefill level of that round (least energy meeting
    both SLOs, else TTFT alone, else the fastest). Seven replays a shape at four levels, not sixteen."""
    mine = [r for r in runs if r["config"].prefill == shape and r["config"].decode is None]
    if not mine:
        return []

    def rank(r: dict[str, Any]) -> tuple[bool, bool, float]:
        res = r["result"]
        return (not _meets(res, cfg, "ttft"), not _meets(res, cfg, "tpot"), float(res["energy_j"]))
    best: OracleConfig = min(mine, key=rank)["config"]
    tried = {r["config"].clocks_mhz for r in mine}
    return [replace(best, clocks_mhz=(best.clocks_mhz[0], d)) for d in dec_pairs
            if (best.clocks_mhz[0], d) not in tried]


def search_oracle(profile: GPUProfile, model: ModelArgs, arrivals: Arrivals, cfg: SimConfig, workers: int = 2,
                  levels: int = 4, shapes: Sequence[tuple[PoolShape, PoolShape | None]] | None = None,
                  levels_mhz: tuple[Sequence[float], Sequence[float]] | None = None,
                  exhaustive: bool = False, top_k: int = 3, name: str = "static-oracle",
                  per_pool: bool = False) -> OracleResult:
    """The least-energy fixed configuration that meets both SLOs over the whole trace (module docstring).

    `per_pool`: one clock for both halves of a pool (`pool-oracle`). A colocated shape (decode None) serves
    both phases in one pool, so its prefill and decode clocks cannot be screened apart: every pair is replayed."""
    pred = cached_predictor(profile, model)
    probe = Simulation(profile, model, arrivals, policy_spec("aflex"), cfg, pred)
    shapes = list(shapes) if shapes is not None else list(oracle_shapes(pred, probe.planner))
    if levels_mhz is None:
        pre_levels, dec_levels = clock_levels(profile, levels, pred.clocks)
    else:
        pre_levels, dec_levels = snap_to_table(levels_mhz[0], pred.clocks), snap_to_table(levels_mhz[1], pred.clocks)

    def pairs(levels_of: list[float], one_clock: bool) -> list[tuple[float, float]]:
        return [(f, f) for f in levels_of] if one_clock else list(itertools.product(levels_of, levels_of))
    pre_grid, dec_grid = pairs(pre_levels, per_pool), pairs(dec_levels, per_pool)
    configs: list[OracleConfig] = []
    start = (min(dec_levels, key=lambda f: abs(f - profile.bandwidth_saturation_mhz)),) * 2
    for ps, ds in shapes:
        if ds is None:  # colocated replicas run both halves at one clock: the diagonal of each phase's grid
            configs += [OracleConfig(ps, ds, (p, d), name) for p in pairs(pre_levels, True)
                        for d in (pairs(dec_levels, True) if exhaustive else [start])]
        elif exhaustive:
            configs += [OracleConfig(ps, ds, (p, d), name) for p in pre_grid for d in dec_grid]
        else:
            n = max(len(pre_grid), len(dec_grid))  # the shorter grid cycles
            configs += [OracleConfig(ps, ds, (pre_grid[k % len(pre_grid)], dec_grid[k % len(dec_grid)]), name)
                        for k in range(n)]
    runs = _run_all([(profile, model, arrivals, cfg, c) for c in configs], workers)
    if not exhaustive:
        split = [(ps, ds) for ps, ds in shapes if ds is not None]
        finals = _finals(profile, runs, split, cfg, top_k, name=name)
        finals += [c for ps, ds in shapes if ds is None
                   for c in _colocated_finals(runs, ps, pairs(dec_levels, True), cfg)]
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


def pool_oracle_shapes(pred: Predictor, planner: SimPlanner, headrooms: Sequence[float] = HEADROOMS,
                       ) -> list[tuple[PoolShape, PoolShape | None]]:
    """`pool-oracle`'s shapes: the P/D instance pools (BiScale's coarse tier) and the colocated pool
    (DynamoLLM's) that the baselines' planners pick for the busiest window, at each headroom."""
    peak = planner.peak_load()
    rule = policy_spec("biscale").clock
    out: list[tuple[PoolShape, PoolShape | None]] = []
    for h in headrooms:
        pd = provision_pd(pred, peak, planner.spec, rule, h)
        colocated = provision_colocated(pred, peak, planner.spec, rule, h)
        for shape in ((pd.prefill, pd.decode), (colocated.mixed, None)):
            if shape[0] is not None and shape not in out:
                out.append(shape)  # type: ignore[arg-type]
    return out


def search_pool_oracle(profile: GPUProfile, model: ModelArgs, arrivals: Arrivals, cfg: SimConfig,
                       workers: int = 2, levels: int = 4) -> OracleResult:
    """`pool-oracle`: the best fixed clock per prefill and decode pool (one clock for both halves), P/D
    instance pools or one colocated pool, that meets both SLOs over the trace, in hindsight: the
    counterfactual for "per-operator clocks beat per-pool clocks"."""
    pred = cached_predictor(profile, model)
    probe = Simulation(profile, model, arrivals, policy_spec("biscale"), cfg, pred)
    return search_oracle(profile, model, arrivals, cfg, workers, levels, pool_oracle_shapes(pred, probe.planner),
                         name="pool-oracle", per_pool=True)

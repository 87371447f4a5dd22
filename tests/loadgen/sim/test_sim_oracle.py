"""The static oracle's grid search, the load sweep and `aflex sim`'s command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen.sim.arrivals import synthetic
from loadgen.sim.engine import SimConfig, Simulation
from loadgen.sim.models import get_model
from loadgen.sim.oracle import OracleConfig, clock_levels, prefill_screen_j, search_oracle
from shared.gpu.emulated import load_profile
from shared.perf import cached_predictor
from shared.policy import PoolShape
from tests.conftest import REPO_ROOT

PROFILE = load_profile("a800")
MODEL = get_model("llama-3-8b")
ARRIVALS = synthetic(3.0, 40.0, 7, burstiness=1.5, prompt_mean=800, output_mean=80)
CFG = SimConfig(gpus=8, window_s=20, tick_s=10)


def test_the_decomposed_grid_finds_the_exhaustive_optimum() -> None:
    """A small case whose optimum is known: every joint combination of the grid replayed (exhaustive),
    against the search that pairs prefill and decode combinations (levels² replays, then the pair)."""
    levels = ([795.0, 1110.0, 1410.0], [345.0, 570.0])
    fast = search_oracle(PROFILE, MODEL, ARRIVALS, CFG, workers=2, levels_mhz=levels)
    full = search_oracle(PROFILE, MODEL, ARRIVALS, CFG, workers=2, levels_mhz=levels, exhaustive=True)
    assert full.result["oracle"]["replays"] == len(full.replays) > fast.result["oracle"]["replays"]
    assert fast.result["oracle"]["feasible"] and full.result["oracle"]["feasible"]
    assert fast.best == full.best
    assert fast.result["energy_j"] == full.result["energy_j"]
    # the optimum is the least energy among the replays that meet both SLOs, and nothing feasible beats it
    ok = [r for r in full.replays if r["p90_ttft_ms"] <= 400 and r["p90_tpot_ms"] <= 120]
    assert full.result["energy_j"] == min(r["energy_j"] for r in ok)


def test_a_tighter_slo_rules_out_the_slow_configurations() -> None:
    """With a TPOT SLO the slowest decode configuration misses, the oracle picks the least-energy one
    among its replays that meet it. (Those are its own replays, not the loose run's: the SLO is the
    budget every iteration is planned under, so a configuration may replay differently under it.)"""
    levels = ([1110.0], [255.0, 570.0, 840.0])
    split = PoolShape(split=True, attention=1, ffn=1)
    loose_cfg = SimConfig(gpus=8, window_s=20, tick_s=10, tpot_slo_s=10.0)
    loose = search_oracle(PROFILE, MODEL, ARRIVALS, loose_cfg, workers=2, levels_mhz=levels, exhaustive=True,
                          shapes=[(split, split)])
    slowest = max(loose.replays, key=lambda r: r["p90_tpot_ms"])
    slo_ms = 0.99 * slowest["p90_tpot_ms"]
    tight_cfg = SimConfig(gpus=8, window_s=20, tick_s=10, tpot_slo_s=slo_ms / 1e3)
    tight = search_oracle(PROFILE, MODEL, ARRIVALS, tight_cfg, workers=2, levels_mhz=levels, exhaustive=True,
                          shapes=[(split, split)])
    still_ok = [r for r in tight.replays if r["p90_tpot_ms"] <= slo_ms]
    assert 0 < len(still_ok) < len(tight.replays)  # the tighter SLO rules some configurations out
    assert tight.result["oracle"]["feasible"] and tight.result["p90_tpot_ms"] <= slo_ms
    assert tight.result["energy_j"] == min(r["energy_j"] for r in still_ok)
    assert tight.best.clocks_mhz != (slowest["clocks_mhz"]["PA"], slowest["clocks_mhz"]["PF"])


def test_the_static_oracle_searches_every_kind_aflex_may_take() -> None:
    """Split P/D pools at a clock per operator, and colocated replicas (issue 38, correction 9), whose two
    halves share one clock per phase, on the diagonal: searched by coordinates (prefill levels at the decode
    level nearest the bandwidth-saturation clock, then decode levels at the best prefill), which finds the
    exhaustive grid's optimum here in one replay fewer."""
    from loadgen.sim.oracle import oracle_shapes
    from loadgen.sim.policies import policy_spec

    probe = Simulation(PROFILE, MODEL, ARRIVALS, policy_spec("aflex"), CFG, cached_predictor(PROFILE, MODEL))
    shapes = oracle_shapes(cached_predictor(PROFILE, MODEL), probe.planner)
    assert any(d is None and not p.split for p, d in shapes) and any(d is not None and p.split for p, d in shapes)
    levels = ([795.0, 1410.0], [345.0, 570.0])
    colocated = [(p, d) for p, d in shapes if d is None][:1]
    fast = search_oracle(PROFILE, MODEL, ARRIVALS, CFG, workers=2, levels_mhz=levels, shapes=colocated)
    full = search_oracle(PROFILE, MODEL, ARRIVALS, CFG, workers=2, levels_mhz=levels, shapes=colocated,
                         exhaustive=True)
    assert len(full.result["oracle"]["grid"]) == 4  # two prefill levels x two decode levels
    grid = fast.result["oracle"]["grid"]
    assert len(grid) == 3 and [g["clocks_mhz"]["DA"] for g in grid[:2]] == [570.0, 570.0]
    assert all(g["clocks_mhz"]["PA"] == g["clocks_mhz"]["PF"] and g["clocks_mhz"]["DA"] == g["clocks_mhz"]["DF"]
               for g in grid)
    assert fast.best == full.best and fast.result["energy_j"] == full.result["energy_j"]


def test_prefill_screening_is_scored_to_a_common_horizon() -> None:
    """Two prefill clock pairs with the same busy energy score the same, although one shared its screening
    replay with a slow decode pair that stretched the run (and the prefill pool's idle tail) by 100 s."""
    shape = PoolShape(split=True, attention=2, ffn=2)
    slow_pair, quick_pair = ((975.0, 975.0), (345.0, 345.0)), ((795.0, 795.0), (840.0, 840.0))
    idle_w = 2 * PROFILE.context_idle_power_at(975.0) + 2 * PROFILE.context_idle_power_at(975.0)
    stretched = {"config": OracleConfig(shape, shape, slow_pair),
                 "result": {"makespan_s": 3700.0, "pool_energy_j": {"prefill": 5e5 + idle_w * 100.0}}}
    on_time = {"config": OracleConfig(shape, shape, quick_pair),
               "result": {"makespan_s": 3600.0, "pool_energy_j": {"prefill": 5e5}}}
    horizon = min(r["result"]["makespan_s"] for r in (stretched, on_time))
    assert prefill_screen_j(PROFILE, stretched, horizon) == pytest.approx(prefill_screen_j(PROFILE, on_time, horizon))
    assert prefill_screen_j(PROFILE, stretched, horizon) < stretched["result"]["pool_energy_j"]["prefill"]


def test_a_fixed_configuration_keeps_its_clocks_and_shapes() -> None:
    shape_args = {"split": True, "attention": 1, "ffn": 1}
    conf = OracleConfig(PoolShape(**shape_args), PoolShape(**shape_args), ((885.0, 1020.0), (480.0, 525.0)))
    sim = Simulation(PROFILE, MODEL, ARRIVALS, conf.spec(), CFG, cached_predictor(PROFILE, MODEL))
    res = sim.run()
    clocks = res["mean_clock_mhz"]
    assert (clocks["prefill-attention"], clocks["prefill-ffn"]) == pytest.approx((885.0, 1020.0))
    assert (clocks["decode-attention"], clocks["decode-ffn"]) == pytest.approx((480.0, 525.0))
    assert len(res["plans"]) == 1 and res["plans"][0]["parked"] == 4 and res["finished"] == res["requests"]
    table = cached_predictor(PROFILE, MODEL).clocks
    pre, dec = clock_levels(PROFILE, 4, table)
    assert len(pre) == len(dec) == 4 and pre[-1] == PROFILE.max_mhz and set(pre + dec) <= set(table.tolist())


def test_the_pool_oracle_holds_one_clock_per_pool_and_is_the_least_feasible_replay() -> None:
    """`pool-oracle`: instance pools (P/D or one colocated pool) at one clock for both halves of each pool;
    its answer is the least energy among its replays that meet both SLOs, and a colocated shape (whose
    phases cannot be screened apart) is searched by coordinates: both prefill levels at the decode level
    nearest the bandwidth-saturation clock, then the other decode level at the better prefill."""
    from loadgen.sim.oracle import pool_oracle_shapes, search_pool_oracle
    from loadgen.sim.policies import policy_spec

    res = search_pool_oracle(PROFILE, MODEL, ARRIVALS, CFG, workers=2, levels=2)
    best = res.best
    (pa, pf), (da, df) = best.clocks_mhz
    assert pa == pf and da == df and not best.prefill.split and best.name == "pool-oracle"
    assert res.result["oracle"]["feasible"] and res.result["finished"] == res.result["requests"]
    ok = [r for r in res.replays if r["p90_ttft_ms"] <= 400 and r["p90_tpot_ms"] <= 120]
    assert res.result["energy_j"] == min(r["energy_j"] for r in ok)
    probe = Simulation(PROFILE, MODEL, ARRIVALS, policy_spec("biscale"), CFG, cached_predictor(PROFILE, MODEL))
    shapes = pool_oracle_shapes(cached_predictor(PROFILE, MODEL), probe.planner)
    colocated = [s for s, d in shapes if d is None]
    assert colocated and {"prefill", "decode"} & set().union(*[set(r) for r in res.replays])
    for shape in colocated:
        mine = [r for r in res.replays if r.get("colocated") == [shape.replicas, shape.tp]]
        assert len(mine) == 3  # 2 prefill levels at one decode level, then the other decode level


def _sim_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "loadgen.sim.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO_ROOT)


def test_the_load_sweep_and_both_accountings_on_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    proc = _sim_cli("--rate", "2", "--duration", "30", "--model", "llama-3-8b", "--gpus", "8", "--window-s", "20",
                    "--policies", "sglang,aflex", "--load", "0.5,2", "--accounting", "active", "--json", str(out),
                    "--plots", str(tmp_path / "plots"))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert set(data["sweep"]) == {"0.5", "2"}
    for policies in data["sweep"].values():
        assert set(policies) == {"sglang", "aflex"}
        for res in policies.values():
            assert set(res) == set(data["policies"]["sglang"]) | ({"oracle"} & set(res))
            assert res["accounting_reported"] == "active"
            assert res["accounting"]["active"]["energy_j"] <= res["accounting"]["cluster"]["energy_j"]
    assert data["sweep"]["2"]["sglang"]["requests"] > data["sweep"]["0.5"]["sglang"]["requests"]
    assert "active E/token" in proc.stderr
    for png in ("clocks_over_time.png", "plans_over_time.png", "energy_vs_load.png"):
        assert (tmp_path / "plots" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (("--load", "0,1"), "--load multipliers must be > 0"),
    (("--load", "fast"), "--load must be comma-separated numbers"),
    (("--policies", "vllm"), "unknown policy 'vllm'"),
    (("--parking", "hot"), "invalid choice: 'hot'"),
    (("--idle-clock-share", "0.9"), "idle clock share must be in"),
    (("--oracle-levels", "1"), "--oracle-levels must be at least 2"),
])
def test_bad_sim_arguments_get_one_clear_line(args: tuple[str, ...], message: str) -> None:
    proc = _sim_cli("--rate", "1", "--duration", "5", "--gpus", "4", "--model", "llama-3-8b", *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr

"""docs/calibration.md, one test per row: each runs the simulator (row 1: the emulated GPU) in the
publication's setting, smaller where the full size would be slow (trace windows; benchmarks/calibration.py
runs every row at full size), and checks the simulated figure against the published one.

A row that lands is checked within 10 points of the published saving. A row that does not is checked
against the band docs/calibration.md states for it, so the page stays true when the model changes.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest

from tests.conftest import REPO_ROOT

ROOT = REPO_ROOT


def _load_calibration() -> Any:
    name = "benchmarks_calibration"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "calibration.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


cal = _load_calibration()
POINTS = cal.POINTS


@pytest.fixture(scope="module")
def runner() -> Any:
    return cal.Runner(verbose=False)


def _saving(res: dict[str, Any], policy: str, base: str, accounting: str) -> float:
    return float(cal.saving(res[policy]["accounting"][accounting]["energy_j"],
                            res[base]["accounting"][accounting]["energy_j"]))


def within(value: float, target: float, points: float) -> bool:
    return abs(value - target) <= points


# -- row 1 ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 32])
def test_row1_clock_locking_saves_about_a_third_of_decode_energy(batch: int) -> None:
    """H200, Llama-3-8B decode at context 1024: the least-energy clock within 1% of t(1830 MHz) saves
    within 10 points of the published 32%; power at 1830 is inside 137–300 W; above 1590 MHz time no
    longer improves. The paper's "1980" sustains 1830 MHz: P(1830)/P(1590) is inside its 7–13% and
    1830 -> 780 MHz inside its 47–90 W; at a literal 1980 MHz the ratio would be 1.20–1.23 (doc)."""
    r = cal.row1_profile(batch=batch)
    assert within(r["saving_pct"], 32.0, POINTS), r
    assert r["slowdown"] <= 1.01
    assert 137.0 <= r["power_base_w"] <= 300.0
    assert r["t1590_over_t1980"] < 1.001
    assert 1.07 <= r["p1830_over_p1590"] <= 1.13
    assert 47.0 <= r["w_saved_1830_to_780"] <= 90.0
    assert 1.18 <= r["p1980_over_p1590"] <= 1.24


def test_row1_one_gpu_sim_locked_clock(runner: Any) -> None:
    """One H200 serving a decode-heavy load, sglang locked at f* against locked at 1830 MHz: the same
    saving per output token as the profile-level figure, at no loss of decode speed."""
    f_star = cal.row1_profile(batch=32)["f_star_mhz"]
    r = cal.row1_sim(runner, rate=3.0, duration=120.0, f_star=f_star)
    assert within(r["saving_pct"], 32.0, POINTS), r
    assert r["p50_tpot_ratio"] <= 1.02
    assert r["tokens_s_fstar"] >= 0.99 * r["tokens_s_1830"]


# -- row 2 ------------------------------------------------------------------------------------------------
def test_row2_voltana_at_the_lowest_rate(runner: Any) -> None:
    """4 x A100 2P2D, Llama-3.1-8B, 50 req/s for 120 s (the full setting): VoltanaLLM and static 1005 MHz
    both land within 10 points of the published 36%, every policy inside both SLOs."""
    res = cal.row2_run(runner, rate=50.0)
    for name in ("voltana", "sglang-1005"):
        assert within(_saving(res, name, "sglang-1410", "active"), 36.3, POINTS), name
    assert all(r["slo_attainment"] >= 0.99 for r in res.values())
    assert res["voltana"]["mean_clock_mhz"]["decode-attention"] == pytest.approx(1005.0)


def test_row2_at_100_rps_the_decode_pool_is_past_its_capacity(runner: Any) -> None:
    """At 100 req/s the modelled 2P2D misses the ITL SLO even at 1410 MHz (under half the requests inside
    both SLOs), yet VoltanaLLM's saving lands within 10 points of the published 10% (16%), and static
    1005 MHz within 10 of 29% (25%)."""
    res = cal.row2_run(runner, rate=100.0)
    assert res["sglang-1410"]["slo_attainment"] < 0.5
    assert within(_saving(res, "voltana", "sglang-1410", "active"), 10.0, POINTS)
    assert within(_saving(res, "sglang-1005", "sglang-1410", "active"), 29.0, POINTS)


# -- row 3 ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["low", "medium", "high"])
def test_row3_dynamollm_against_tp8_at_max_clock(runner: Any, level: str) -> None:
    """2 TP8 servers of H100, Llama-3.3-70B, the first 600 s of the conv trace at x1, x2, x4 (a quarter,
    half and all of the baseline's SLO capacity). Each level lands within 10 points of 51%, 40% and 23.4%
    (cluster accounting), DynamoLLM inside both SLOs. High landed at 10% while the two servers ran in lock
    step, a long prefill on one stretching the other's iteration (issue 38, row 7)."""
    load, published = cal.ROW3_LOADS[level]
    res = cal.row3_run(runner, "conv", load, gpus=16, window=(0.0, 600.0))
    s = _saving(res, "dynamollm", "sglang", "cluster")
    assert within(s, published, POINTS), s
    assert res["dynamollm"]["p90_tpot_ms"] <= 100.0 and res["dynamollm"]["p90_ttft_ms"] <= 400.0
    assert res["sglang"]["slo_attainment"] >= 0.85


# -- row 4 ------------------------------------------------------------------------------------------------
def test_row4_throttling_autoscaling_and_both(runner: Any) -> None:
    """8 x A100, Llama-3-8B, one TP8 engine, the first 600 s of the conv trace at x2 (half the baseline's
    capacity), cluster accounting. Throttling alone and both land within 10 points of 30.6% and 43.8%;
    autoscaling alone saves 35% (± 4), not 20.8%, since a quarter of the fleet holds this load."""
    res = cal.row4_run(runner, "conv", window=(0.0, 600.0))
    assert within(_saving(res, "phase-dvfs", "sglang", "cluster"), 30.6, POINTS)
    assert within(_saving(res, "dynamollm", "sglang", "cluster"), 43.8, POINTS)
    assert abs(_saving(res, "dynamollm-no-dvfs", "sglang", "cluster") - 35.0) <= 4.0
    assert all(r["slo_attainment"] >= 0.95 for r in res.values())


# -- row 5 ------------------------------------------------------------------------------------------------
def test_row5a_operator_clocks(runner: Any) -> None:
    """16 x A800, Qwen3-32B, the first 300 s of the conv trace. The static baselines run at 1410 MHz
    (> 1300, as published). AFlex's prefill clocks sit at 1100–1350 MHz against the published 656/452
    (a miss, doc: with no prompt pipelined against itself, as live, holding TTFT takes faster prefill
    clocks; its colocated replicas' mixed iterations spend banked decode slack at ~1170) and its decode
    clocks at 350–850 MHz; DynamoLLM's and BiScale's decode clocks sit at 350–480 MHz,
    not above 1300 (doc: a miss; the shared clock objective scores decode above the idle floor)."""
    runs = cal.row5_run(runner, "conv", "qwen3-32b", ("aflex", *cal.ROW5_BASELINES), window=(0.0, 300.0))
    clocks = {k: r[0]["mean_clock_mhz"] for k, r in runs.items()}
    for name in ("sglang", "distserve"):
        assert min(clocks[name].values()) > 1300.0
    aflex = clocks["aflex"]
    assert all(1100.0 <= aflex[k] <= 1350.0 for k in ("prefill-attention", "prefill-ffn"))
    assert all(350.0 <= aflex[k] <= 850.0 for k in ("decode-attention", "decode-ffn"))
    for name in ("dynamollm", "biscale"):
        assert 350.0 <= clocks[name]["decode-attention"] <= 480.0


def test_row5b_global_scheduler_and_local_dvfs(runner: Any) -> None:
    """16 x A800, Qwen3-32B, the first 300 s of the conv trace at x1, cluster accounting. The global
    scheduler alone saves 30–50% against af-max and 15–30% against distserve sized to the load (the
    published 5.9–37.3% spans loads); local DVFS on top of it costs energy (−8 to −1%: with no prompt
    pipelined against itself, as live, it spends on prefill clocks to hold TTFT) against the published
    20.1% saving (doc: a miss)."""
    runs = cal.row5_run(runner, "conv", "qwen3-32b", cal.ROW5B_POLICIES, window=(0.0, 300.0))
    res = {k: r[0] for k, r in runs.items()}
    assert 30.0 <= _saving(res, "aflex-global-only", "af-max", "cluster") <= 50.0
    assert 15.0 <= _saving(res, "aflex-global-only", "distserve", "cluster") <= 30.0
    assert -8.0 <= _saving(res, "aflex", "aflex-global-only", "cluster") <= -1.0

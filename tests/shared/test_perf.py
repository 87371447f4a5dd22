"""Predictors: exactness of the aggregate attention work, MAPE on held-out points, online correction."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from loadgen.sim.models import get_model
from shared.gpu.emulated import load_profile, operator_cost
from shared.gpu.workload import attention_work
from shared.perf import Predictor, _grid, attention_work_agg, cached_predictor, causal_pairs


@pytest.fixture(scope="module")
def pred() -> Predictor:
    return cached_predictor(load_profile("a800"), get_model("qwen3-32b"))


def mape(pred: Predictor, op: str, phase: str, points: int, seed: int, clocks: Sequence[float] | None = None) -> float:
    """Mean absolute percentage error of the predicted time against the cost model it was fitted to, on points
    the fit never sampled (another seed), at clocks drawn from `clocks` (default: the fitted ones)."""
    rng = np.random.default_rng(seed)
    n, ctx, pairs = _grid(op, phase, rng, points)
    fs = rng.choice(list(clocks) if clocks is not None else list(pred.clocks), size=points)
    errs = []
    for i in range(points):
        true, _ = pred.measure(op, phase, n[i], ctx[i], pairs[i], fs[i])
        errs.append(abs(pred.predict_at(op, phase, n[i], ctx[i], pairs[i], fs[i]) - true) / true)
    return float(np.mean(errs))


def test_aggregate_attention_work_matches_workload() -> None:
    args = get_model("qwen3-32b")
    ctxs = [300, 1200, 4000]
    ref = attention_work(args, 3, ctxs)
    agg = attention_work_agg(args, 3, sum(ctxs), sum(causal_pairs(1, c) for c in ctxs))
    assert agg.flops == pytest.approx(ref.flops)
    assert agg.bytes_moved == pytest.approx(ref.bytes_moved)
    prof = load_profile("a800")
    assert operator_cost(prof, agg, 900).time_s == pytest.approx(operator_cost(prof, ref, 900).time_s)


@pytest.mark.parametrize("op", ["attention", "ffn"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_mape_on_held_out_points(pred: Predictor, op: str, phase: str) -> None:
    limit = 0.11 if phase == "prefill" else 0.02  # AFlex: < 11% prefill, about 2% decode
    assert mape(pred, op, phase, points=80, seed=999) < limit


def test_mape_between_fitted_clocks(pred: Predictor) -> None:
    off_grid = [c + 15 for c in pred.clocks[:-1]]  # supported clocks the fit never sampled
    assert mape(pred, "ffn", "decode", points=60, seed=7, clocks=off_grid) < 0.05


def test_power_rises_with_clock(pred: Predictor) -> None:
    p = pred.power_w("ffn", "prefill", 4096)
    assert p[-1] > p[0]


def test_observe_moves_the_ewma_correction() -> None:
    p = Predictor.for_profile(load_profile("a800"), get_model("llama-3-8b"), clock_step_mhz=150, samples=80)
    t = p.predict_at("ffn", "decode", 32, 0, 0, 1410)
    for _ in range(30):
        p.observe("ffn", "decode", 32, 0, 0, 1410, measured_s=1.5 * t)
    assert p.predict_at("ffn", "decode", 32, 0, 0, 1410) == pytest.approx(1.5 * t, rel=0.02)


def test_a_time_correction_keeps_the_operators_power_until_an_energy_is_measured() -> None:
    """A slow GPU's operator runs k times longer at the model's power: its energy is k times the model's
    (priced by time alone, a slower GPU would look as if it drew less power, and a plan of more GPUs cheaper)."""
    p = Predictor.for_profile(load_profile("a800"), get_model("llama-3-8b"), clock_step_mhz=150, samples=80)
    t0, e0 = p.predict("attention", "decode", 16, 4096, 0)
    p.correction[("attention", "decode")] = 4.0
    t4, e4 = p.predict("attention", "decode", 16, 4096, 0)
    assert t4 == pytest.approx(4 * t0) and e4 == pytest.approx(4 * e0)  # the same power at every clock
    p.observe("attention", "decode", 16, 4096, 0, 1410, measured_s=4 * float(t0[-1]), measured_j=2 * float(e0[-1]))
    _, measured = p.predict("attention", "decode", 16, 4096, 0)
    assert float(measured[-1]) < 4 * float(e0[-1])  # a measured energy takes over

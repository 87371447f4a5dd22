"""The per-request decode budget: the simulator's heap form is the definition, the invariant holds, the live
planner and governor take the same figure, and in a replay the banked slack lowers AFlex's prefill clocks."""

from __future__ import annotations

import random

import pytest

from loadgen.sim.arrivals import synthetic
from loadgen.sim.engine import SimConfig, Simulation
from loadgen.sim.models import get_model
from loadgen.sim.policies import policy_spec
from services.scheduler.aflex import BATCHING, AflexPlanner, IterationSample
from services.scheduler.governor import least_allowances
from services.scheduler.state import RequestState, Status
from shared.gpu.emulated import load_profile
from shared.messages import SamplingSpec
from shared.perf import cached_predictor
from shared.policy.decode_slack import DecodeSlack, allowance_s, iteration_budget_s


def test_the_heap_is_the_least_allowance_of_the_running_requests() -> None:
    rng = random.Random(7)
    per_token = 0.1
    slack = DecodeSlack(per_token)
    running: dict[int, tuple[float, int]] = {}  # rid -> (first token s, admitted iteration)
    now, rid = 0.0, 0
    for iteration in range(400):
        if running and rng.random() < 0.3:
            gone = rng.choice(sorted(running))
            del running[gone]
            slack.leave(gone)
        for _ in range(rng.randrange(3)):
            first = now - rng.uniform(0.0, 0.5)  # its first token came a while ago (prefill, KV hand-off)
            running[rid] = (first, iteration)
            slack.admit(rid, first, iteration)
            rid += 1
        direct = min((allowance_s(per_token, iteration - a, now - f) for f, a in running.values()), default=None)
        got = slack.least_allowance_s(now, iteration)
        assert (got == float("inf")) if direct is None else got == pytest.approx(direct, abs=1e-9)
        assert len(slack) == len(running)
        now += rng.uniform(0.01, 0.3)


def test_spending_every_allowance_keeps_the_mean_tpot_within_the_budget() -> None:
    """The worst case: every iteration takes its whole budget. Whenever the request ends, its mean time per
    token is within the larger of the per-token budget and the step's floor (the SLO margins' figure)."""
    rng = random.Random(3)
    per_token, first = 0.05, 10.0
    for _ in range(20):
        floor = per_token * rng.uniform(0.5, 1.2)
        now = first
        for d in range(200):
            if rng.random() < 0.3:  # an iteration that came in under its budget banks the difference
                now += floor * rng.uniform(0.1, 1.0)
            else:
                now += iteration_budget_s(floor, allowance_s(per_token, d, now - first), cap_s=0.4)
            assert (now - first) / (d + 1) <= max(per_token, floor) + 1e-12
    assert iteration_budget_s(0.1, 5.0, cap_s=0.4) == 0.4 and iteration_budget_s(0.1, 0.02, cap_s=0.4) == 0.1


def _decoding(rid: str, worker: str, tokens: int, first_ts: float) -> RequestState:
    s = RequestState(rid, [5] * 8, SamplingSpec(max_tokens=500), 0.0)
    s.worker_id, s.first_token_ts, s.status = worker, first_ts, Status.RUNNING
    s.output_ids = [100] * tokens
    return s


def test_the_live_governor_and_planner_take_the_same_allowance() -> None:
    now = 1000.0
    reqs = [_decoding("a", "w0", 11, now - 0.5), _decoding("b", "w0", 3, now - 0.1),
            _decoding("c", "w1", 2, now - 0.3), _decoding("d", "w1", 1, now - 1.0)]
    reqs[3].first_token_ts = None  # still prefilling: nothing banked, nothing owed yet
    got = least_allowances(reqs, 0.1, now)
    assert got == pytest.approx({"w0": min(0.1 * 11 - 0.5, 0.1 * 3 - 0.1), "w1": 0.1 * 2 - 0.3})
    pl = AflexPlanner(get_model("qwen3-32b"), ttft_slo_ms=400, tpot_slo_ms=120, depths=(1, 2, 3, 4))
    assert BATCHING.decode_slack and pl.batching.decode_slack
    rep = IterationSample(0.0, "decode", 8, 8 * 500.0, 8 * 500.0, 8, 8, 0)
    step = pl.budget_s("decode", rep)
    assert pl.budget_s("decode", rep, banked_s=0.3) == pytest.approx(0.3)  # banked: a longer iteration
    assert pl.budget_s("decode", rep, banked_s=5.0) == pytest.approx(0.4)  # never past the TTFT SLO
    assert pl.budget_s("decode", rep, banked_s=0.01) == step  # behind: the step's budget, no tighter


def test_banked_slack_lowers_aflex_prefill_clocks_within_the_tpot_slo() -> None:
    profile, model = load_profile("a800"), get_model("llama-3-8b")
    arr = synthetic(3.0, 60.0, 1, burstiness=1.5, prompt_mean=800, output_mean=120)
    config = SimConfig(gpus=8, window_s=30, tick_s=10, tpot_slo_s=0.05)
    res = {}
    for name in ("aflex", "aflex-no-decode-slack"):
        spec = policy_spec(name)
        assert spec.batching.decode_slack == (name == "aflex")
        res[name] = Simulation(profile, model, arr, spec, config, cached_predictor(profile, model)).run()
    slack, step = res["aflex"], res["aflex-no-decode-slack"]
    assert slack["p90_tpot_ms"] <= 50.0 and slack["slo_met"]
    assert slack["mean_clock_mhz"]["prefill-attention"] < step["mean_clock_mhz"]["prefill-attention"]
    assert slack["energy_per_token_j"] < step["energy_per_token_j"]

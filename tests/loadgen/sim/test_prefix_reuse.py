"""The simulator's prefix reuse (issue 27): a share of each prompt found in a prefix cache, in whole blocks,
is neither prefilled nor charged, but the prefill still attends to it; tokens are counted as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loadgen.sim.arrivals import PREFIX_BLOCK_TOKENS, Arrivals, load_trace, synthetic, with_prefix_reuse
from loadgen.sim.engine import SimConfig, Simulation
from loadgen.sim.models import get_model
from loadgen.sim.policies import policy_spec
from shared.gpu.emulated import load_profile
from shared.perf import cached_predictor

PROFILE = load_profile("a800")
MODEL = get_model("llama-3-8b")


def _sim(arr: Arrivals, policy: str = "sglang", **cfg: object) -> dict:
    config = SimConfig(gpus=8, window_s=30, tick_s=10, **cfg)  # type: ignore[arg-type]
    return Simulation(PROFILE, MODEL, arr, policy_spec(policy), config, cached_predictor(PROFILE, MODEL)).run()


def test_reuse_is_whole_blocks_of_each_prompt_and_leaves_its_last_token() -> None:
    arr = synthetic(5.0, 60.0, 3, prompt_mean=900, output_mean=50)
    arr = Arrivals(arr.time_s, np.concatenate([arr.prompt, [1, 16, 17, 33]]), np.concatenate([arr.output, [1] * 4]))
    cached = with_prefix_reuse(arr, 0.7).cached
    assert cached is not None
    assert np.all(cached % PREFIX_BLOCK_TOKENS == 0) and np.all(cached <= arr.prompt - 1) and np.all(cached >= 0)
    assert np.all(cached <= 0.7 * arr.prompt)
    assert list(cached[-4:]) == [0, 0, 0, 16]  # 1 and 16 tokens: nothing to reuse, the last one is computed
    assert cached.sum() / arr.prompt.sum() == pytest.approx(0.7, abs=0.03)
    assert all(arr.prefill_tokens(i) == arr.prompt[i] for i in range(3))  # no cache: the whole prompt
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="prefix reuse must be in"):
            with_prefix_reuse(arr, bad)


def test_a_trace_may_carry_cached_tokens_per_request(tmp_path: Path) -> None:
    csv = tmp_path / "t.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,CachedTokens\n"
                   "2023-11-16 18:15:46.6805900,400,20,256\n"
                   "2023-11-16 18:15:46.1805900,100,5,500\n")
    arr = load_trace(str(csv))
    assert list(arr.prompt) == [100, 400] and arr.cached is not None
    assert list(arr.cached) == [99, 256]  # sorted with its request; never the whole prompt
    assert load_trace(str(csv), max_input_len=200).cached.tolist() == [99, 199]  # type: ignore[union-attr]


def _run(arr: Arrivals, policy: str, **cfg: object) -> tuple[Simulation, dict]:
    config = SimConfig(gpus=8, window_s=30, tick_s=10, **cfg)  # type: ignore[arg-type]
    sim = Simulation(PROFILE, MODEL, arr, policy_spec(policy), config, cached_predictor(PROFILE, MODEL))
    return sim, sim.run()


@pytest.mark.parametrize("policy", ["sglang", "distserve", "dynamollm", "aflex"])
def test_cached_prefixes_cut_prefill_work_and_ttft_with_the_same_tokens_counted(policy: str) -> None:
    """The prefill GPU time falls with the share cached, TTFT with it; every token is still counted. Energy
    falls too, except on SGLang's fixed colocated pool: its replicas decode in lock step in this model, so
    shorter requests mean more, smaller decode iterations, each reading every replica's weights (noted on
    issue 27 as a modelling limit of colocated pools at low load)."""
    arr = synthetic(4.0, 60.0, 5, burstiness=1.5, prompt_mean=2000, output_mean=40)
    (cold_sim, cold), (warm_sim, warm) = _run(arr, policy), _run(arr, policy, prefix_reuse=0.75)
    assert cold["finished"] == warm["finished"] == len(arr)
    assert cold["tokens"] == warm["tokens"] and cold["cached_tokens"] == 0
    assert warm["cached_tokens"] == pytest.approx(0.75 * arr.prompt.sum(), rel=0.03)
    assert warm_sim.clock_time["prefill-ffn"] < cold_sim.clock_time["prefill-ffn"]  # AFlex: at lower clocks
    assert warm["p50_ttft_ms"] < cold["p50_ttft_ms"]
    if policy != "sglang":
        assert warm["energy_j"] < cold["energy_j"] and warm["energy_per_token_j"] < cold["energy_per_token_j"]


def test_a_cached_prefix_is_attended_to_though_not_prefilled() -> None:
    """800 new tokens after a 3,200-token cached prefix cost more than an 800-token prompt alone: the
    chunk's queries read the whole context (what the live worker computes)."""
    n = 40
    t = np.arange(n) * 0.5
    long_prompt = Arrivals(t, np.full(n, 4000), np.ones(n, dtype=np.int64), np.full(n, 3200))
    short_prompt = Arrivals(t, np.full(n, 800), np.ones(n, dtype=np.int64))
    cached, fresh = _sim(long_prompt), _sim(short_prompt)
    assert cached["cached_tokens"] == 3200 * n and fresh["cached_tokens"] == 0
    assert cached["energy_j"] > fresh["energy_j"]
    assert cached["energy_j"] < _sim(Arrivals(t, np.full(n, 4000), np.ones(n, dtype=np.int64)))["energy_j"]

"""AFlex's provisioning headroom follows the TTFT the last window saw (shared/policy/headroom.py)."""

from __future__ import annotations

import pytest

from shared.policy.headroom import AdaptiveHeadroom


def test_misses_grow_it_to_a_cap_and_quiet_windows_relax_it_to_the_base() -> None:
    h = AdaptiveHeadroom(base=1.3)
    assert h.update(None, 400) == pytest.approx(1.3)  # nothing started: nothing learned
    assert h.update(500, 400) == pytest.approx(1.3 * 1.15)
    for _ in range(20):
        h.update(900, 400)
    assert h.headroom == pytest.approx(2.6)  # at most twice the base
    assert h.update(350, 400) == pytest.approx(2.6)  # inside the SLO but not comfortably: held
    for _ in range(200):
        h.update(100, 400)
    assert h.headroom == pytest.approx(1.3)  # never below the base


def test_every_scaling_policy_plans_with_it_and_static_ones_do_not() -> None:
    """Shared machinery (issue 38): the baselines that re-plan every window correct their headroom as AFlex does."""
    from loadgen.sim.arrivals import synthetic
    from loadgen.sim.engine import SimConfig, Simulation
    from loadgen.sim.models import get_model
    from loadgen.sim.policies import policy_spec
    from shared.gpu.emulated import load_profile
    from shared.perf import cached_predictor

    prof, model = load_profile("a800"), get_model("mixtral-8x7b")
    arr = synthetic(1.0, 30.0, 1, prompt_mean=500, output_mean=50)
    for name, adaptive in (("aflex", True), ("aflex-pd-only", True), ("dynamollm", True), ("biscale", True),
                           ("af-max", False), ("sglang", False)):
        sim = Simulation(prof, model, arr, policy_spec(name), SimConfig(gpus=8), cached_predictor(prof, model))
        assert (sim.headroom is not None) == adaptive, name

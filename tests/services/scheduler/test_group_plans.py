"""The live planner and the simulator plan the same groups (issue 53): one call, one cluster, one load.

The simulator's AFlex planner (`SimPlanner.window`) plans a cluster free to form any group the model splits
over; a live mesh's workers are the groups they were started as (`--attention-tp`, `--ffn-tp`, `--ffn-ep`).
Started with the groups the simulator's plan names (and the rest of the cluster as one-device attention
workers, which the simulator may form too), the live planner (`Provisioner.plan`) must return the same plan,
and give each pool workers whose devices add up to it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from loadgen.sim.arrivals import Arrivals
from loadgen.sim.models import get_model
from loadgen.sim.planning import SimPlanner
from loadgen.sim.policies import policy_spec
from services.scheduler.fleet_plan import Observed, Provisioner
from shared.gpu.emulated import load_profile
from shared.kinds import PARKED
from shared.model.config import ModelArgs
from shared.perf import cached_predictor
from shared.policy import SHARED_CLOCK_OBJECTIVE, ClockRule, ClusterSpec, Plan, WindowLoad
from shared.policy.parking_rule import model_parking_state, parked_power_w
from shared.policy.pool_sizing import LiveGroups

A800 = load_profile("a800")
RULE = ClockRule(objective=SHARED_CLOCK_OBJECTIVE)
TTFT_MS, TPOT_MS, LINK = 1000.0, 120.0, 400e9


def _provisioner() -> Provisioner:
    return Provisioner(window_s=300.0, ttft_slo_ms=TTFT_MS, tpot_slo_ms=TPOT_MS, link_bytes_s=LINK, parking="warm")


def _sim_plan(model: ModelArgs, gpus: int, load: WindowLoad, kinds: tuple[str, ...]) -> tuple[Plan, ClusterSpec]:
    """The simulator's AFlex planner's plan for `load` on `gpus` GPUs (pool kinds `kinds`)."""
    parked_w = parked_power_w(model_parking_state("warm", A800, model, 300.0), A800)
    spec = ClusterSpec.for_model(model, gpus, ttft_slo_s=TTFT_MS / 1e3, tpot_slo_s=TPOT_MS / 1e3, link_bytes_s=LINK,
                                 parked_power_w=parked_w, gpu_memory_bytes=A800.memory_bytes)
    empty = Arrivals(np.zeros(0), np.zeros(0, dtype=int), np.zeros(0, dtype=int))
    policy = replace(policy_spec("aflex"), kinds=kinds)
    planner = SimPlanner(policy, spec, cached_predictor(A800, model), empty, 300.0, 1.3, 30.0, 0.9)
    planner.window(load)
    assert planner.last_plan is not None
    return planner.last_plan, spec


def _groups_of(plan: Plan, gpus: int) -> dict[str, tuple[str, int]]:
    """A live mesh started with `plan`'s groups: worker id -> (role, devices); the GPUs the plan leaves out as
    one-device attention workers. Whole-model workers are "w*", other attention workers "a*", FFN "f*"."""
    workers: dict[str, tuple[str, int]] = {}
    for shape in plan.pools().values():
        if not shape.split:
            workers |= {f"w{len(workers) + i}": ("whole", shape.tp) for i in range(shape.replicas)}
            continue
        tp = shape.attention_tp
        workers |= {f"a{len(workers) + i}": ("attention", tp) for i in range(shape.attention // tp)}
        workers[f"f{len(workers)}"] = ("ffn", shape.ffn)
    if not any(role == "ffn" for role, _ in workers.values()):
        workers["f-spare"] = ("ffn", 1)  # a live mesh has an FFN worker, parked under a colocated plan
    spare = gpus - sum(size for _, size in workers.values())
    workers |= {f"a-spare{i}": ("attention", 1) for i in range(spare)}
    return workers


LOADS = {  # (model, GPUs, load, the AFlex kinds weighed)
    "qwen3-32b colocated TP2+ replicas": ("qwen3-32b", 10, WindowLoad(2.0, 1200, 250, 4000), ("colocated",)),
    "qwen3-32b colocated TP2+ replicas, busier": ("qwen3-32b", 10, WindowLoad(5.0, 1200, 250, 4000), ("colocated",)),
    "mixtral-8x7b, an FFN group of 2+": ("mixtral-8x7b", 8, WindowLoad(3.0, 1000, 200, 3000), ("mixed",)),
    "mixtral-8x7b, an FFN group of 2+, busier": ("mixtral-8x7b", 8, WindowLoad(15.0, 1000, 200, 3000), ("mixed",)),
    "qwen3-32b, P/D with a TP prefill group": ("qwen3-32b", 16, WindowLoad(2.0, 3000, 100, 6000), ("pd",)),
    "qwen3-32b, AFlex's kinds": ("qwen3-32b", 12, WindowLoad(4.0, 1500, 300, 5000), ("pd", "colocated")),
}


@pytest.mark.parametrize("case", LOADS)
def test_a_mesh_started_with_the_simulators_groups_plans_what_the_simulator_plans(case: str) -> None:
    name, gpus, load, kinds = LOADS[case]
    model = get_model(name)
    sim, _ = _sim_plan(model, gpus, load, kinds)
    assert sim.feasible
    workers = _groups_of(sim, gpus)
    if case.startswith("qwen3-32b colocated"):
        assert sim.kind == "colocated" and sim.mixed is not None and sim.mixed.tp >= 2  # 64 GB: no TP 1 replica
    if case.startswith("mixtral"):
        assert sim.mixed is not None and sim.mixed.ffn >= 2  # ~90 GB of experts: no one-GPU FFN
    if "TP prefill" in case:
        assert sim.prefill is not None and sim.prefill.attention_tp >= 2
    sizes = {w: size for w, (_, size) in workers.items()}
    attention = sorted(w for w, (role, _) in workers.items() if role != "ffn")
    ffn = sorted(w for w, (role, _) in workers.items() if role == "ffn")
    whole = [w for w, (role, _) in workers.items() if role == "whole"]
    pv = _provisioner()
    d = pv.plan(0.0, cached_predictor(A800, model), RULE, attention, ffn, kinds=kinds,
                observed=Observed(load, None, None), colocate_ids=whole, sizes=sizes)
    assert d.plan == sim
    # each pool's workers hold its devices: attention groups of its TP, the FFN group, replicas of the TP
    for pool, shape in sim.pools().items():
        held = [w for w, p in d.pool_of.items() if p == pool]
        if not shape.split:
            assert {sizes[w] for w in held} == {shape.tp} and len(held) == shape.replicas
            continue
        att = [w for w in held if d.assignments[w] != "ffn"]
        assert {sizes[w] for w in att} == {shape.attention_tp} and sum(sizes[w] for w in att) == shape.attention
        assert sum(sizes[w] for w in held if d.assignments[w] == "ffn") == shape.ffn
    serving = sum(sizes[w] for w, a in d.assignments.items() if a not in PARKED)
    assert serving == sim.gpus and gpus - serving == sim.parked


def test_a_live_plan_uses_only_the_groups_the_mesh_has() -> None:
    """Qwen3-32B: the simulator's cheapest colocated replica is TP2 here; a mesh of TP4 workers plans TP4
    replicas, and one with no whole-model group of a size that holds the model has no colocated plan."""
    model = get_model("qwen3-32b")
    load = WindowLoad(1.0, 1000, 200, 3000)
    sim, spec = _sim_plan(model, 10, load, ("colocated",))
    assert sim.mixed is not None and sim.mixed.tp == 2
    pred = cached_predictor(A800, model)
    tp4 = {"w0": 4, "w1": 4, "f0": 2}
    d = _provisioner().plan(0.0, pred, RULE, ["w0", "w1"], ["f0"], kinds=("colocated",),
                            observed=Observed(load, None, None), colocate_ids=["w0", "w1"], sizes=tp4)
    assert d.plan.mixed is not None and d.plan.mixed.tp == 4 and d.plan.parked == 10 - 4 * d.plan.mixed.replicas
    groups = LiveGroups((4, 4), (2,), (4, 4))
    assert groups.limit(spec).colocated_groups == (4, 4) and groups.limit(spec).ffn_sizes == (2,)
    single = LiveGroups((1, 1), (2,), (1, 1))  # both halves on one 80 GB GPU: Qwen3-32B's 64 GB does not fit
    assert single.limit(spec).colocated_groups == (1, 1)
    from shared.policy.colocated import colocated_options

    assert colocated_options(single.limit(spec)) == []


def test_the_simulator_plans_only_ffn_groups_the_model_splits_over() -> None:
    """Qwen3-32B's FFN width (25600) splits over 1, 2, 4, 5, 8 and 10 GPUs, not 3: no plan names an FFN of 3."""
    spec = ClusterSpec.for_model(get_model("qwen3-32b"), 10, ttft_slo_s=1.0, tpot_slo_s=0.1, link_bytes_s=LINK,
                                 parked_power_w=50.0)
    assert spec.ffn_sizes == (1, 2, 4, 5, 8, 10)
    mixtral = ClusterSpec.for_model(get_model("mixtral-8x7b"), 8, ttft_slo_s=1.0, tpot_slo_s=0.1, link_bytes_s=LINK,
                                    parked_power_w=50.0)
    assert mixtral.ffn_sizes is not None and 6 not in mixtral.ffn_sizes and {2, 4, 8} <= set(mixtral.ffn_sizes)

"""Colocated replicas, live (issue 26): attention workers started with `colocate` hold both halves, and the
global scheduler may run the whole model on them, one replica per worker, the FFN workers parked.

Pure tests of the plan and the mapping first (the simulator's colocated search, limited to the workers
that hold both halves, TP 1); then the scheduler on a real nats-server with fake workers: a colocated
worker's microbatches name itself as their FFN worker. (The tokens of a real colocated worker are the
engine's: tests/test_mesh_colocated.py.)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from loadgen.sim.models import get_model
from services.scheduler.fleet_plan import Provisioner, assign
from services.scheduler.model_info import ModelInfo
from services.scheduler.registry import Registry
from shared import subjects
from shared.gpu.emulated import EmulatedGPU, load_profile
from shared.messages import Register, RegisterReply, decode, encode
from shared.perf import cached_predictor
from shared.policy import SHARED_CLOCK_OBJECTIVE, ClockRule, Plan, PoolShape, WindowLoad
from shared.policy.footprint import candidate_plans, elastic_plan
from shared.policy.pool_sizing import LiveGroups, mixed_power
from tests.services.scheduler.test_scheduler import heartbeat, wait_for
from tests.services.scheduler.test_scheduler_policy import A800_CLOCKS, ProfiledAttention, live

LLAMA = get_model("llama-3-8b")  # fits one A800 whole (Qwen3-32B does not: it has no TP 1 replica)
QWEN = get_model("qwen3-32b")
A800 = load_profile("a800")
RULE = ClockRule(objective=SHARED_CLOCK_OBJECTIVE)


def _provisioner() -> Provisioner:
    return Provisioner(window_s=60.0, ttft_slo_ms=400, tpot_slo_ms=120, link_bytes_s=400e9, parking="warm")


def test_a_colocated_plan_runs_one_replica_per_worker_that_holds_both_halves() -> None:
    pv = _provisioner()
    pred = cached_predictor(A800, LLAMA)
    for i in range(240):  # 4 req/s of 1000-token prompts
        pv.loads.admitted(f"r{i}", 100.0 + i / 4, 1000, 300)
    d = pv.plan(160.0, pred, RULE, ["a0", "a1", "a2"], ["f0", "f1"], kinds=("colocated",), colocate_ids=["a1", "a2"])
    spec = pv.spec(LLAMA, A800, LiveGroups.ones(3, 2, 2))
    assert spec.colocated_groups == (1, 1)
    assert d.plan == elastic_plan(pred, d.load, spec, RULE, 1.3, None, kinds=("colocated",))
    shape = d.plan.mixed
    assert d.plan.kind == "colocated" and shape is not None and not shape.split and shape.tp == 1
    # the plan is the cheapest of every replica count the two workers allow (checked exhaustively)
    hl = WindowLoad(d.load.rate_rps * 1.3, d.load.mean_prompt, d.load.mean_output, d.load.p90_prompt)
    total = ClockRule(objective="total")
    powers = {r: mixed_power(pred, PoolShape(split=False, replicas=r, link_bytes_s=spec.link_bytes_s), hl, spec,
                             total) + (5 - r) * spec.parked_power_w for r in (1, 2)}
    assert shape.replicas == min(powers, key=lambda r: powers[r])
    assert d.plan.predicted_power_w == pytest.approx(powers[shape.replicas])
    # its replicas are workers holding both halves; the rest park, the FFN workers too
    replicas = {w for w, a in d.assignments.items() if a == "colocated"}
    assert len(replicas) == shape.replicas and replicas <= {"a1", "a2"}
    assert {w for w, a in d.assignments.items() if a == "parked-warm"} == {"a0", "a1", "a2", "f0", "f1"} - replicas
    # the next window keeps the same replicas where it can
    again = pv.plan(160.0, pred, RULE, ["a0", "a1", "a2"], ["f0", "f1"], kinds=("colocated",),
                    colocate_ids=["a1", "a2"])
    assert again.plan == d.plan and again.changed == [] and again.plan_id == d.plan_id + 1


def test_no_colocated_plan_without_a_worker_that_holds_the_whole_model() -> None:
    pred = cached_predictor(A800, LLAMA)
    pv = _provisioner()
    load = WindowLoad(1.0, 500.0, 200.0, 800.0)
    assert "colocated" not in candidate_plans(pred, load, pv.spec(LLAMA, A800, LiveGroups.ones(2, 2, 0)), RULE)
    assert "colocated" in candidate_plans(pred, load, pv.spec(LLAMA, A800, LiveGroups.ones(2, 2, 1)), RULE)
    # asked for colocated replicas where none can run: the mixed pool serves instead
    d = pv.plan(0.0, pred, RULE, ["a0", "a1"], ["f0"], kinds=("colocated",), colocate_ids=[])
    assert d.plan.kind == "mixed" and "colocated" not in d.assignments.values()
    qwen = pv.plan(0.0, cached_predictor(A800, QWEN), RULE, ["a0", "a1"], ["f0"], kinds=("colocated",),
                   colocate_ids=["a0", "a1"])  # both halves loaded, but 64 GB of weights want TP 2
    assert qwen.plan.kind == "mixed"


def test_assign_gives_colocated_places_only_to_workers_with_both_halves() -> None:
    plan = Plan(None, None, PoolShape(split=False, replicas=2), 3, 100.0, True)
    previous = {"a0": "mixed-attention", "a1": "parked-warm", "a2": "colocated", "f0": "ffn"}
    got, pool_of = assign(plan, ["a0", "a1", "a2"], ["f0"], previous, colocate_ids=["a1", "a2"])  # type: ignore[arg-type]
    assert got == {"a0": "parked-warm", "a1": "colocated", "a2": "colocated", "f0": "parked-warm"}
    assert pool_of["a2"] == "colocated" and pool_of["f0"] == ""


@dataclass
class WholeAttention(ProfiledAttention):
    """A fake attention worker that registers both halves, as `colocate` does."""

    async def start(self) -> None:
        await self.nc.subscribe(subjects.attn_mb(self.worker_id), cb=self._on_mb)
        reg = Register(worker_id=self.worker_id, role="attention", model_id="test-model", n_layers=2,
                       kv_total_blocks=self.kv_total_blocks, block_size=self.block_size, max_seq_len=4096,
                       gpu_backend="emulated", gpu_name=self.gpu_name, gpu_profile=self.gpu_profile,
                       supported_clocks_mhz=self.clocks, halves=["attention", "ffn"])
        assert decode(RegisterReply, (await self.nc.request(subjects.CONTROL_REGISTER, encode(reg), 5)).data).ok
        self._hb = asyncio.create_task(heartbeat(self.nc, self.worker_id, "attention", self.kv_total_blocks))


def test_a_colocated_worker_is_its_own_ffn_worker_and_the_ffn_workers_park(nats_url: str) -> None:
    model = ModelInfo("test-model", frozenset({2}), vocab_size=1000, max_seq_len=4096, args=LLAMA)

    async def main() -> None:
        a0 = WholeAttention(None, "a0", kv_total_blocks=20000)  # type: ignore[arg-type]
        async with live(nats_url, a0, model, provision_window_s=0.5, freq_window_s=0.5,
                        provision_kinds="colocated") as lv:
            await lv.ffn("f0")
            reg = lv.sched.registry.workers
            await wait_for(lambda: reg["a0"].assignment == "colocated" and reg["f0"].assignment == "parked-warm", 10)
            assert reg["a0"].can_colocate and not reg["f0"].can_colocate
            dones = [await lv.submit(f"r{i}", 20, 6) for i in range(8)]
            await asyncio.wait_for(asyncio.gather(*(d.wait() for d in dones)), 20)
            sent = [d for d in a0.descriptors if d.seqs]
            assert sent and all(d.ffn_worker == "a0" for d in sent)  # no hop: the worker runs the FFN itself
            # its clocks come from a one-clock plan (both halves on one GPU); the parked FFN worker idles lowest
            await lv.sched.freq_window()
            await wait_for(lambda: any(c.reason.startswith("aflex (") for c in lv.commands.get("a0", [])), 10)
            plans = lv.sched.governor.plans["a0"]
            assert plans and all(not p.shape.split and p.op.clock_attention == p.op.clock_ffn for p in plans.values())
            assert lv.commands["f0"][-1].clocks_mhz == {"prefill": A800_CLOCKS[0], "decode": A800_CLOCKS[0]}
    asyncio.run(main())


def test_the_cluster_is_planned_on_the_memory_the_workers_registered() -> None:
    """Qwen3-32B's 64 GB of weights want TP 2 on 80 GB A800s, but one 141 GB H200 holds them: the GPU's memory,
    as registered (the emulated profile's, or NVML's total), decides whether a colocated replica fits."""
    h200 = load_profile("h200")
    assert A800.memory_bytes == 80e9 and h200.memory_bytes == 141e9
    assert EmulatedGPU("h200").memory_bytes() == 141e9
    reg = Registry()
    worker, _ = reg.register(Register(worker_id="a0", role="attention", model_id="m", n_layers=2,
                                      gpu_memory_bytes=141e9, halves=["attention", "ffn"]), 0.0)
    assert worker.gpu_memory_bytes == 141e9 and worker.can_colocate
    pv = _provisioner()
    pred = cached_predictor(h200, QWEN)
    load = WindowLoad(1.0, 500.0, 200.0, 800.0)
    two = LiveGroups.ones(2, 1, 2)
    assert "colocated" in candidate_plans(pred, load, pv.spec(QWEN, h200, two), RULE)  # the profile's 141 GB
    assert "colocated" not in candidate_plans(pred, load, pv.spec(QWEN, h200, two, gpu_memory_bytes=80e9), RULE)
    d = pv.plan(0.0, pred, RULE, ["a0", "a1"], ["f0"], kinds=("colocated",), colocate_ids=["a0", "a1"],
                gpu_memory_bytes=141e9)
    assert d.plan.kind == "colocated"

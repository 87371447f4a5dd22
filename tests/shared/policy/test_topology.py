"""Every tensor-parallel group pays its reductions, over the link its GPUs share (issue 38, corrections 5-6).

16 A800s are two 8-GPU nodes: a group that exchanges tensors every layer runs at NVLink while it fits
one node and at the inter-node network once it does not (`ClusterSpec.group_link_bytes_s`); a split
pool's FFN group all-reduces its down projection before the hop back (`pipeline.iteration_cost`), as
an attention group and a colocated replica already did. Checked against a direct reckoning with
constant per-layer costs, and through the planner and the simulator that price with them.
"""

from __future__ import annotations

import pytest

from loadgen.sim.arrivals import synthetic
from loadgen.sim.config import SimConfig
from loadgen.sim.engine import Simulation
from loadgen.sim.models import get_model
from loadgen.sim.policies import policy_spec
from shared.gpu.emulated import load_profile
from shared.perf import cached_predictor
from shared.policy import BatchStats, ClusterSpec, PoolShape
from shared.policy.colocated import instance_pool
from shared.policy.pipeline import allreduce_s, group_layer_s, iteration_cost, seam_transfer_s

NVLINK, NETWORK = 400e9, 25e9
DIM, LAYERS = 4096, 10
TA, TF, TH = 2e-3, 3e-3, 1e-3  # one layer's attention and FFN time on one GPU's share, the LM head's


def _spec(node_gpus: int = 8) -> ClusterSpec:
    return ClusterSpec.for_model(get_model("qwen3-32b"), 16, ttft_slo_s=0.4, tpot_slo_s=0.12, link_bytes_s=NVLINK,
                                 parked_power_w=40.0, node_gpus=node_gpus, inter_node_bytes_s=NETWORK)


def test_a_group_runs_at_nvlink_inside_a_node_and_at_the_network_across_nodes() -> None:
    spec = _spec()
    assert spec.group_link_bytes_s(8) == NVLINK and spec.group_link_bytes_s(9) == NETWORK
    assert _spec(node_gpus=0).group_link_bytes_s(16) == NVLINK  # one NVLink domain
    assert instance_pool(2, 8, spec).link_bytes_s == NVLINK  # a TP8 replica stays inside its node


def _costs(shard_seen: list[int]):  # type: ignore[no-untyped-def]
    def att(n: float, ctx: float, pairs: float, shard: int) -> tuple[float, float]:
        return TA, TA * 300.0

    def ffn(n: float, shard: int) -> tuple[float, float]:
        shard_seen.append(shard)
        return TF, TF * 300.0

    def head(n: float, shard: int) -> tuple[float, float]:
        return TH, TH * 300.0

    return att, ffn, head


@pytest.mark.parametrize("link", [NVLINK, NETWORK])
def test_the_ffn_group_pays_its_all_reduce(link: float) -> None:
    """Depth 1, decode: each layer is attention, the hop, the FFN with its group's collectives (rank 0's command
    with the rows, the all-reduce, the energy sum), the hop back."""
    n = 64.0
    stats = BatchStats("decode", n, n * 1000.0, n * 1000.0, n)
    shards: list[int] = []
    for ffn_gpus in (1, 4):
        shape = PoolShape(split=True, attention=2, ffn=ffn_gpus, link_bytes_s=link, attention_tp=1)
        t, _ = iteration_cost(*_costs(shards), shape, stats, 1, DIM, LAYERS, 50.0, 50.0)
        tc = seam_transfer_s(n, DIM, link)
        ar_f = group_layer_s("ffn", n, DIM, ffn_gpus, link)  # 0 for one FFN GPU
        assert t == pytest.approx(LAYERS * (TA + TF + ar_f + 2 * tc) + TH)
    assert shards == [1, 4]
    rows = n * DIM * 2
    assert group_layer_s("ffn", n, DIM, 4, link) == pytest.approx(
        allreduce_s(n, DIM, 4, link) + 3 * 10e-6 + (1024 + rows + 8) / link)


def test_the_planner_prices_a_pool_across_nodes_at_the_network() -> None:
    """The provisioner's split pools carry their link: more than 8 GPUs run at the network's rate, which
    the planner's candidates (`point_tables`, the live governor's and the simulator's) see as a slower pool."""
    from shared.policy import ClockRule
    from shared.policy.operating_point import point_tables
    from shared.policy.pool_sizing import _pool

    spec = _spec()
    assert _pool(4, 4, spec).link_bytes_s == NVLINK and _pool(4, 10, spec).link_bytes_s == NETWORK
    pred = cached_predictor(load_profile("a800"), get_model("qwen3-32b"))
    stats = BatchStats("prefill", 4000.0, 4000.0, 2e6, 2.0, n_seqs=2)

    def at_top(shape: PoolShape) -> float:
        return float(point_tables(pred, shape, stats, ClockRule(max_clock=True, depths=(1,))).depths[0].time_s[0, 0])

    assert at_top(_pool(4, 10, spec)) > at_top(_pool(4, 10, _spec(node_gpus=0)))


def test_kv_caches_cross_nodes_when_a_pd_pair_fills_more_than_one() -> None:
    prof, model = load_profile("a800"), get_model("qwen3-32b")
    arr = synthetic(1.0, 20.0, 1, prompt_mean=500, output_mean=20)
    for node_gpus, decode_tp, link in ((8, 2, NETWORK), (8, 1, NVLINK), (0, 2, NVLINK)):
        sim = Simulation(prof, model, arr, policy_spec("distserve"), SimConfig(gpus=16, node_gpus=node_gpus),
                         cached_predictor(prof, model))
        sim._apply_plan(0.0, {"prefill": PoolShape(split=False, replicas=2, tp=2),
                              "decode": PoolShape(split=False, replicas=3, tp=decode_tp)})
        assert sim._kv_link_bytes_s(sim.pools["prefill/0"]) == link, (node_gpus, decode_tp)  # an instance's pool

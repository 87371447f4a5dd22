"""Pure policy: batching, microbatch depth, provisioning and clock selection (no I/O, no wall clock).

The live scheduler and the simulator (`loadgen.sim`) call the same objects."""

from shared.policy.batching import (
    BatchingRule,
    decode_admit,
    prefill_budget,
    prefill_order,
    seq_chunk_cap,
    ttft_budget,
)
from shared.policy.clocks import BatchStats, ClockRule, OperatingPoint, PoolShape, SloMargin, plan_iteration
from shared.policy.pipeline import af_iteration, colocated_iteration, iteration_cost, megascale_depth, overlap_floor
from shared.policy.provision import ClusterSpec, Plan, WindowLoad, provision

__all__ = [
    "BatchStats", "BatchingRule", "ClockRule", "ClusterSpec", "OperatingPoint", "Plan", "PoolShape", "SloMargin",
    "WindowLoad", "af_iteration", "colocated_iteration", "decode_admit", "iteration_cost", "megascale_depth",
    "overlap_floor", "plan_iteration", "prefill_budget", "prefill_order", "provision", "seq_chunk_cap", "ttft_budget",
]

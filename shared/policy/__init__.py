"""Pure policy: batching, iteration forming, microbatch depth, provisioning and clock selection (no I/O,
no wall clock).

The live scheduler and the simulator (`loadgen.sim`) call the same objects; the in-process engine forms
its steps with `form_iteration` too."""

from shared.policy.batching import (
    BatchingRule,
    decode_admit,
    prefill_budget,
    prefill_order,
    seq_chunk_cap,
    ttft_budget,
)
from shared.policy.iteration import (
    Feed,
    IterationForm,
    IterationPlan,
    IterationPolicy,
    KvRoom,
    PrefillQuery,
    WorkItem,
    form_iteration,
    microbatch_depth,
    parse_depth,
    plan_iteration,
    planner_depths,
    split_microbatches,
)
from shared.policy.operating_point import (
    BatchStats,
    ClockRule,
    OperatingPoint,
    PoolShape,
    SloMargin,
    choose_operating_point,
)
from shared.policy.pipeline import af_iteration, colocated_iteration, iteration_cost, megascale_depth, overlap_floor
from shared.policy.pool_sizing import ClusterSpec, Plan, WindowLoad, provision
from shared.policy.specs import AFLEX_BATCHING, SHARED_BATCHING, SHARED_CLOCK_OBJECTIVE

__all__ = [
    "AFLEX_BATCHING", "SHARED_BATCHING", "SHARED_CLOCK_OBJECTIVE", "BatchStats", "BatchingRule", "ClockRule",
    "ClusterSpec", "Feed",
    "IterationForm", "IterationPlan", "IterationPolicy", "KvRoom", "OperatingPoint", "Plan", "PoolShape",
    "PrefillQuery",
    "SloMargin", "WindowLoad", "WorkItem", "af_iteration", "choose_operating_point", "colocated_iteration",
    "decode_admit", "form_iteration", "iteration_cost", "megascale_depth", "microbatch_depth", "overlap_floor",
    "parse_depth", "plan_iteration", "planner_depths", "prefill_budget", "prefill_order", "provision",
    "seq_chunk_cap", "split_microbatches", "ttft_budget",
]

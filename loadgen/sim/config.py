"""The simulator's run settings: cluster size, SLOs, windows, parking and which accounting is reported.

`fixed-pool` is the paper's accounting (a fixed set of A800 nodes): every GPU of the cluster is charged
from start to end at the context-idle power of the clock it is at, and no policy may park cold. It is
a run of its own (parking is forced warm), whose `cluster` books are then the fixed-pool figures.
`active` is a deployment too: a parked GPU is handed back, so the scaling planners price it at 0 W
(`planner_parked_w`); its replay's `active` books are the figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.kinds import ParkingChoice

ACCOUNTINGS = ("cluster", "active", "fixed-pool")


def planner_parked_w(accounting: str, parked_w: float) -> float:
    """What a GPU outside the plan costs every scaling policy's planner (W): nothing under `active`
    accounting, whose deployment hands a parked GPU back (a cloud or shared pool) and pays only for the
    plan's GPUs; its parking state's power under `cluster` and `fixed-pool`, which own every GPU."""
    return 0.0 if accounting == "active" else parked_w


@dataclass
class SimConfig:
    gpus: int = 16
    ttft_slo_s: float = 0.4
    tpot_slo_s: float = 0.12
    link_bytes_s: float = 400e9  # A/F seam and TP all-reduce inside a node (A800 NVLink); KV transfer P->D too
    # 16 A800s are two 8-GPU HGX nodes; a GPU reaches the other node through its own 200 Gb/s HDR NIC (DGX
    # A100's compute fabric: 8 single-port ConnectX-6, one per GPU): 25 GB/s. A group larger than a node
    # (a split pool's per-layer traffic, a P/D pair's KV) runs at that rate. node_gpus 0: one NVLink domain
    node_gpus: int = 8
    inter_node_bytes_s: float = 25e9
    switch_delay_s: float | None = None  # None: the profile's clock_switch_delay
    window_s: float = 300.0
    tick_s: float = 30.0
    headroom: float = 1.3
    parking: ParkingChoice = "auto"  # GPUs outside a scaling policy's plan: "warm", "cold", or "auto" (break-even)
    # which accounting the top-level energy fields report (cluster and active are always in; fixed-pool
    # forces warm parking, and is in when asked for)
    accounting: str = "cluster"
    colocated_tp: int | None = None  # None: the smallest TP that holds the model and fits the p90 prompt
    burst_subwindow_s: float = 30.0  # dynamic provisioning sizes for a quantile of these sub-window rates
    burst_quantile: float = 0.9  # 0.5 ~ the window's mean rate; 1.0 its busiest sub-window
    record_power: bool = False
    seed: int = 0
    # share of prompt tokens a prefix cache holds (arrivals.with_prefix_reuse); None: the trace's own
    # CachedTokens, or no reuse. Only the rest is prefilled and charged, as live
    prefix_reuse: float | None = None

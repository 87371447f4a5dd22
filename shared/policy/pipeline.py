"""Time and energy of one serving iteration, from per-operator costs: the pipeline model.

Used twice with the same formulas: by the policy on predicted arrays (over candidate clocks) and
by the simulator on the emulated GPU's costs at the clocks it chose. Shapes broadcast: attention
arrays (Ca, 1) and FFN arrays (1, Cf) give (Ca, Cf) tables.

Split (attention/FFN disaggregated), depth m microbatches, L layers, per-microbatch attention time
ta (one attention GPU's share, its group's all-reduce included), FFN time tf (one FFN GPU's share, the
FFN group's all-reduce included), one-way transfer tc:

    cycle = max(m·ta, m·tf, ta + tf + 2·tc, r)    (resource-bound, or one microbatch's round trip)
    T     = L·cycle + t_head

where r is the round trip of the microbatch holding the iteration's largest sequence chunk: the
scheduler cuts microbatches between sequences, never inside one (`split_microbatches`), so one
prompt's tokens never pipeline against each other; m ≥ 2 overlaps only different sequences.

m = 1 is the plain sequential path L·(ta + tf + 2tc); with m ≥ 2 the sides overlap (ping-pong) and
the round trip is hidden once m·max(ta, tf) ≥ ta + tf + 2tc, MegaScale-Infer's m ≥ 2(1 + tc/tf)
when ta = tf. Every GPU not computing within T idles at its context-idle power for the clock it is
locked at (bubbles cost; `idle_a` for the attention GPUs, `idle_f` for the FFN GPUs, arrays over
the clock tables like the costs, or floats at the chosen clocks).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

Array = np.ndarray


def overlap_floor(t_comm_s: float, t_compute_s: float) -> float:
    """MegaScale-Infer's depth floor m ≥ 2·(1 + T_comm/T_compute) for a fully hidden round trip."""
    if t_compute_s <= 0:
        return math.inf
    return 2.0 * (1.0 + t_comm_s / t_compute_s)


def megascale_depth(t_comm_s: float, t_compute_s: float, max_depth: int = 4) -> int:
    """The smallest integer depth at or above the overlap floor, in [2, max_depth] (3 when tc < tf/2)."""
    floor = overlap_floor(t_comm_s, t_compute_s)
    return int(min(max_depth, max(2, math.ceil(floor - 1e-9))))


Idle = Array | float  # context-idle power (W) of one GPU, over a clock table or at one clock


def _maximum(a: Any, b: Any) -> Any:
    """np.maximum, without numpy's per-call cost when both are plain floats (the simulator's truth path)."""
    if type(a) is float and type(b) is float:
        return a if a >= b else b
    return np.maximum(a, b)


def af_iteration(ta: Array, ea: Array, tf: Array, ef: Array, th: Array, eh: Array, tc: float, depth: int,
                 layers: int, n_attention: int, n_ffn: int, idle_a: Idle, idle_f: Idle,
                 round_trip_s: Array | float = 0.0) -> tuple[Array, Array]:
    """(time_s, energy_j) of one split iteration; all GPUs of both sides included. `round_trip_s`: one
    layer's round trip of the largest microbatch, when it is larger than an even share (0: none)."""
    m = depth
    cycle = _maximum(_maximum(_maximum(m * ta, m * tf), ta + tf + 2.0 * tc), round_trip_s)
    t = layers * cycle + th
    busy_a = layers * m * ta + th
    busy_f = layers * m * tf
    e = n_attention * (layers * m * ea + eh + idle_a * (t - busy_a))
    e = e + n_ffn * (layers * m * ef + idle_f * (t - busy_f))
    return t, e


def colocated_iteration(ta: Array, ea: Array, tf: Array, ef: Array, th: Array, eh: Array, t_allreduce: float,
                        layers: int, gpus: int, idle_w: Idle) -> tuple[Array, Array]:
    """(time_s, energy_j) of one iteration on `gpus` GPUs (replicas × TP) running both halves at one clock."""
    t = layers * (ta + tf + 2.0 * t_allreduce) + th
    e = gpus * (layers * (ea + ef + 2.0 * t_allreduce * idle_w) + eh)
    return t, e


def seam_transfer_s(tokens: float, dim: int, link_bytes_s: float, dtype_bytes: int = 2,
                    latency_s: float = 10e-6) -> float:
    """One-way A↔F transfer of a microbatch's seam tensors (hidden + residual)."""
    return latency_s + tokens * dim * dtype_bytes * 2.0 / link_bytes_s


def allreduce_s(tokens: float, dim: int, tp: int, link_bytes_s: float, dtype_bytes: int = 2,
                latency_s: float = 10e-6) -> float:
    """One ring all-reduce of the hidden state across `tp` GPUs (0 for tp = 1)."""
    if tp <= 1:
        return 0.0
    return collective_s("all-reduce", tokens * dim * dtype_bytes, tp, link_bytes_s, latency_s)


COMMAND_HEAD_BYTES = 1024  # a group command's first broadcast (shared/transport/device_group.py's HEAD_BYTES)
SUM_BYTES = 8  # the FFN step's energy, summed over the ranks (one float64)


def group_collectives(side: str, tokens: float, dim: int, tp: int, dtype_bytes: int = 2, first_layer: bool = False
                      ) -> list[tuple[str, float]]:
    """The collectives one layer of a microbatch of `tokens` rows costs a group of `tp` ranks, as the live mesh
    issues them (services/attention_worker/follower.py, services/ffn_worker/follower.py): (kind, bytes) each.

    - "attention" (an attention group beside FFN workers): `ATTEND`, the command's head and the layer's FFN
      output that came over the seam to rank 0 (none before the first layer), then o_proj's all-reduce;
    - "ffn" (an FFN group): `FFN`, the head and the rows rank 0 took from the seam, down's all-reduce, and the
      step's energy summed;
    - "whole" (a whole-model group): `ATTEND` and `FFN`, each a head and an all-reduce (the FFN input is the
      same on every rank, so nothing else travels).
    A worker of one device runs none."""
    if tp <= 1:
        return []
    rows = tokens * dim * dtype_bytes
    if side == "attention":
        sent = [] if first_layer else [("broadcast", rows)]
        return [("broadcast", float(COMMAND_HEAD_BYTES)), *sent, ("all-reduce", rows)]
    if side == "ffn":
        return [("broadcast", float(COMMAND_HEAD_BYTES)), ("broadcast", rows), ("all-reduce", rows),
                ("sum", float(SUM_BYTES))]
    if side == "whole":
        return [("broadcast", float(COMMAND_HEAD_BYTES)), ("all-reduce", rows)] * 2
    raise ValueError(f"a group's side is attention, ffn or whole, not {side!r}")


def collective_s(kind: str, nbytes: float, tp: int, link_bytes_s: float, latency_s: float = 10e-6) -> float:
    """One collective over `tp` ranks: a ring all-reduce moves 2(tp-1)/tp of the bytes per rank; a broadcast
    (pipelined, NCCL's ring) or a sum of a few numbers moves them once."""
    if kind == "all-reduce":
        return latency_s + 2.0 * (tp - 1) / tp * nbytes / link_bytes_s
    return latency_s + nbytes / link_bytes_s


def group_layer_s(side: str, tokens: float, dim: int, tp: int, link_bytes_s: float, layers: int = 1,
                  dtype_bytes: int = 2) -> float:
    """A group's collectives per layer (`group_collectives`), in seconds, averaged over `layers` layers (the
    first carries no FFN output into an attention group)."""
    if tp <= 1:
        return 0.0
    first = sum(collective_s(k, b, tp, link_bytes_s)
                for k, b in group_collectives(side, tokens, dim, tp, dtype_bytes, first_layer=True))
    rest = sum(collective_s(k, b, tp, link_bytes_s) for k, b in group_collectives(side, tokens, dim, tp, dtype_bytes))
    return (first + (layers - 1) * rest) / max(1, layers)


def pad_to(t: Array, e: Array, t_floor: Array, idle_w: Idle) -> tuple[Array, Array]:
    """A GPU's share (t, e) stretched to at least `t_floor`, the extra time idle (a straggler elsewhere)."""
    t2 = _maximum(t, t_floor)
    return t2, e + idle_w * (t2 - t)


AttnCost = Callable[[float, float, float, int], tuple[Array, Array]]  # (n, ctx, pairs, shard) -> (t, e)
TokCost = Callable[[float, int], tuple[Array, Array]]  # (n, shard) -> (t, e)


def iteration_cost(att: AttnCost, ffn: TokCost, head: TokCost, shape: Any, s: Any, depth: int, dim: int, layers: int,
                   idle_a: Idle, idle_f: Idle) -> tuple[Array, Array]:
    """(time_s, energy_j) of one iteration of `s` (a BatchStats) on `shape` (a PoolShape).

    The cost callables give one layer's per-GPU (time, energy) of a share of the work; the policy
    passes the predictors (arrays over clocks), the simulator the emulated GPU at the chosen clocks.
    The work is spread evenly over the pool's groups (replicas, or attention TP groups) that hold a
    sequence (`BatchStats.busy_units`; the others idle through the iteration), except that
    the largest single sequence chunk (`s.seq_*`) runs on one group: every GPU's share is stretched
    to at least that chunk's time there, the difference idle, and on the split path that chunk is one
    microbatch, whose own attention, FFN and hops follow each other within each layer (`af_iteration`'s
    round trip). Every tensor-parallel group pays its collectives as the live mesh runs them (`group_layer_s`):
    an attention group's output projection and its leader's command, the FFN group's down projection, command
    and energy sum, a colocated replica's two of each a layer. A colocated pool runs both halves at the
    attention clock, so only `idle_a` applies there."""
    link = shape.link_bytes_s
    if shape.split:
        tp = max(1, shape.attention_tp)
        groups = s.busy_units(shape.units)
        idle_gpus = shape.attention - groups * tp  # attention groups with no sequence this iteration
        per = groups * depth
        ta, ea = att(s.n_tokens / per, s.ctx_tokens / per, s.pairs / per, tp)
        if tp > 1:  # the attention output projection's partial sums, reduced inside the group, and the command
            ar = group_layer_s("attention", s.n_tokens / per, dim, tp, link, layers)
            ta, ea = ta + ar, ea + ar * idle_a
        tf, ef = ffn(s.n_tokens / depth, shape.ffn)
        if shape.ffn > 1:  # the FFN group's command, its row-parallel partial sums reduced before the hop back
            ar_f = group_layer_s("ffn", s.n_tokens / depth, dim, shape.ffn, link, layers)
            tf, ef = tf + ar_f, ef + ar_f * idle_f
        round_trip: Array | float = 0.0
        if s.seq_tokens > s.n_tokens / per:
            ts, _ = att(s.seq_tokens, s.seq_ctx, s.seq_pairs, tp)
            ts = ts + group_layer_s("attention", s.seq_tokens, dim, tp, link, layers)
            ta, ea = pad_to(ta, ea, ts / depth, idle_a)  # its group's microbatches hold it between them
            if depth > 1:  # and it is one of them, whole: its layer's round trip is not overlapped with itself
                ts_f, _ = ffn(s.seq_tokens, shape.ffn)
                ts_f = ts_f + group_layer_s("ffn", s.seq_tokens, dim, shape.ffn, link, layers)
                round_trip = ts + ts_f + 2.0 * seam_transfer_s(s.seq_tokens, dim, link)
        th, eh = head(max(1.0, s.n_sample / groups), tp)
        tc = seam_transfer_s(s.n_tokens / depth, dim, link)
        t, e = af_iteration(ta, ea, tf, ef, th, eh, tc, depth, layers, groups * tp, shape.ffn, idle_a, idle_f,
                            round_trip)
        return t, e + idle_gpus * idle_a * t
    r = s.busy_units(shape.replicas)
    ta, ea = att(s.n_tokens / r, s.ctx_tokens / r, s.pairs / r, shape.tp)
    tf, ef = ffn(s.n_tokens / r, shape.tp)
    ar = group_layer_s("whole", s.n_tokens / r, dim, shape.tp, link, layers) / 2.0  # one of each half's
    if s.seq_tokens > s.n_tokens / r:
        ts, _ = att(s.seq_tokens, s.seq_ctx, s.seq_pairs, shape.tp)
        ts_f, _ = ffn(s.seq_tokens, shape.tp)
        t_share = ta + tf + 2.0 * ar
        t_seq = ts + ts_f + group_layer_s("whole", s.seq_tokens, dim, shape.tp, link, layers)
        stretch = _maximum(t_seq - t_share, 0.0)  # put the straggler's extra time on the FFN share
        tf, ef = tf + stretch, ef + stretch * idle_a
    th, eh = head(max(1.0, s.n_sample / r), shape.tp)
    t, e = colocated_iteration(ta, ea, tf, ef, th, eh, ar, layers, r * shape.tp, idle_a)
    return t, e + (shape.replicas - r) * shape.tp * idle_a * t  # replicas with no sequence idle meanwhile

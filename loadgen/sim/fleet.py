"""The cluster's GPUs as the simulator moves them: pools that iterate, GPUs parked outside the plan, and
GPUs rejoining it.

A plan gives each pool a shape. A pool that grows takes GPUs from parking, warm first (they rejoin
after one clock switch), then cold (after a model load: their weight share over the host link plus
a new context, `GPUProfile.cold_rejoin_s`), and what parking lacks from pools that shrink, when
those free them (`deficit`; the moved GPUs load their new role's weights). A pool takes its new shape
at its first idle moment once every GPU it waits for is ready; GPUs it no longer needs go to
parking in the policy's state. Rejoining GPUs draw context-idle power at f_max and count as in the
plan; parked ones draw their state's power (ledger.py). A new shape that re-shards the GPUs a pool keeps
(`reshards`: a replica's TP, a split pool's attention TP or FFN width) stalls the pool while they load
their new shares over the host link, as a GPU moving between pools does (issue 38: DynamoLLM's TP
changes were free; its paper's cost is not published). KV migration is free: not modelled.

A plan of another kind (P/D pools, one mixed pool, colocated replicas: `Plan.kind`) brings pools of
other names: a new pool starts empty and grows as above; a pool the plan no longer names *retires*:
it takes no new work, finishes what it holds (its queue and its running sequences), and only then
gives its GPUs to the pools waiting for them, or to parking.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

from loadgen.sim.ledger import EnergyLedger
from shared.gpu.emulated import GPUProfile
from shared.kinds import PARKED_ASSIGNMENT, ParkedState
from shared.policy import ClockRule, OperatingPoint, PoolShape
from shared.policy.decode_slack import DecodeSlack
from shared.policy.pool_sizing import idle_power_w

# the ledger's groups of parked GPUs, named as the live scheduler's assignments of a parking state
WARM, COLD = PARKED_ASSIGNMENT["warm"], PARKED_ASSIGNMENT["cold"]


@dataclass
class Pool:
    mode: str  # "mixed", "prefill", "decode", "colocated" (`pool_mode` of its name)
    shape: PoolShape
    queue: deque[list[int]] = field(default_factory=deque)  # [rid, remaining prompt tokens]
    queued_tokens: int = 0
    heap: list[tuple[int, int]] = field(default_factory=list)  # (finish iteration, rid)
    n_run: int = 0
    ctx_sum: float = 0.0
    iters: int = 0
    busy_until: float = -1.0
    idle_since: float = 0.0
    op: OperatingPoint | None = None
    pending: tuple[list[tuple[int, int]], int] | None = None  # prefill chunk [(rid, q)], decode tokens
    waiting: deque[int] = field(default_factory=deque)  # decode admission wait list
    next_shape: PoolShape | None = None  # the plan's shape, taken at the first idle moment from `next_at`
    next_at: float = 0.0
    joining: int = 0  # GPUs rejoining for `next_shape` (from parking, or freed by a pool that shrank)
    deficit: int = 0  # GPUs `next_shape` still waits for another pool to free
    rule: ClockRule | None = None  # the window's fixed clocks (global scheduler only), else the policy's
    retiring: bool = False  # out of the plan: finishes what it holds, then gives its GPUs back
    energy_j: float = 0.0  # the pool's own iterations and idle stretches (cluster accounting)
    slack: DecodeSlack | None = None  # its running requests' banked TPOT (a batching rule with `decode_slack`)


REPLICA_SEP = "/"  # a colocated plan's replicas run as pools of their own: "colocated/0", "colocated/1", ...


def replica_pools(shapes: dict[str, PoolShape]) -> dict[str, PoolShape]:
    """A plan's pools as the simulator runs them: each colocated replica its own pool (one replica each, its
    own queue and iteration loop, as each replica of a live mesh is its own worker), split pools as they
    are (their attention groups share the FFN GPUs, which take the groups' microbatches in one step)."""
    out: dict[str, PoolShape] = {}
    for name, shape in shapes.items():
        if shape.split:
            out[name] = shape
        else:
            out.update({f"{name}{REPLICA_SEP}{i}": replace(shape, replicas=1) for i in range(shape.replicas)})
    return out


def backlog(pool: Pool) -> tuple[int, int]:
    """What a pool has yet to serve: prompt tokens queued, then sequences running or waiting to (the
    least backlogged replica takes the next request, as a live router sends it to the least loaded)."""
    return pool.queued_tokens, pool.n_run + len(pool.waiting)


def pool_mode(name: str) -> str:
    """The mode of the pool named `name` (a replica's pool: its plan pool's)."""
    return name.split(REPLICA_SEP, 1)[0]


def reshards(old: PoolShape, new: PoolShape) -> bool:
    """Whether the GPUs a pool keeps from `old` hold other weights in `new`: a replica's TP changed, or a split
    pool's attention TP or FFN width (its FFN GPUs shard the FFN over all of them). More or fewer replicas
    or attention groups of the same TP leave the kept GPUs' weights as they are."""
    if not old.gpus or not new.gpus or old.split != new.split:
        return False
    if not new.split:
        return old.tp != new.tp
    return old.attention_tp != new.attention_tp or old.ffn != new.ffn


def empty_like(shape: PoolShape) -> PoolShape:
    """A pool of the same kind with no GPUs: a pool not yet grown, or retired."""
    return replace(shape, attention=0, ffn=0, replicas=0)


class Fleet:
    def __init__(self, profile: GPUProfile, gpus: int, switch_delay_s: float, weights: dict[str, float],
                 parking: ParkedState, ledger: EnergyLedger) -> None:
        self.profile, self.gpus, self.switch_delay = profile, gpus, switch_delay_s
        self.weights, self.parking, self.ledger = weights, parking, ledger
        self.pools: dict[str, Pool] = {}
        self.rejoins: list[tuple[float, int, str, float]] = []  # (time, GPUs, from state, delay s)
        self.reshards: list[tuple[float, int, float]] = []  # (time, GPUs kept, stall s)

    # -- energy ---------------------------------------------------------------------------------
    def idle_w(self, pool: Pool) -> float:
        """The pool's GPUs waiting at the clocks they are locked at (the default clock before any iteration)."""
        default = self.profile.default_mhz
        fa, ff = (pool.op.clock_attention, pool.op.clock_ffn) if pool.op else (default, default)
        return idle_power_w(self.profile, pool.shape, fa, ff)

    def charge(self, pool: Pool, t0: float, t1: float, joules: float) -> None:
        """`joules` the pool's GPUs spent over [t0, t1], on the books and on the pool's own tally."""
        self.ledger.charge(t0, t1, pool.shape.gpus, joules)
        pool.energy_j += joules

    def close_idle(self, pool: Pool, now: float) -> None:
        if now > pool.idle_since:
            self.charge(pool, pool.idle_since, now, self.idle_w(pool) * (now - pool.idle_since))
        pool.idle_since = max(pool.idle_since, now)

    def parked(self, now: float, warm: int, cold: int) -> None:
        led = self.ledger
        led.set_group(WARM, now, warm, self.profile.warm_parked_power_w, in_plan=False)
        led.set_group(COLD, now, cold, self.profile.idle_power_w, in_plan=False)

    def park(self, now: float, count: int) -> None:
        """`count` more GPUs leave the plan, into the policy's parking state."""
        warm, cold = self.ledger.group_count(WARM), self.ledger.group_count(COLD)
        to_warm = count if self.parking == "warm" else 0
        self.parked(now, warm + to_warm, cold + count - to_warm)

    # -- provisioning -------------------------------------------------------------------------
    def share_bytes(self, shape: PoolShape) -> float:
        """Weight bytes one rejoining GPU loads: its role's share (the larger role's, if split)."""
        wa, wf = self.weights["attention"], self.weights["ffn"]
        if not shape.split:
            return (wa + wf) / max(1, shape.tp)
        return max(wa / max(1, shape.attention_tp), wf / max(1, shape.ffn))

    def rejoin_group(self, now: float) -> None:
        self.ledger.set_group("rejoin", now, sum(p.joining for p in self.pools.values()),
                              self.profile.context_idle_power_w, in_plan=True)

    def apply(self, now: float, shapes: dict[str, PoolShape]) -> None:
        """Give each pool its planned shape. A growing pool takes GPUs from parking (warm first: one clock
        switch; then cold: a model load), and what parking lacks from pools that shrink, when they
        free them (`deficit`); a pool takes its new shape at its first idle moment once they are ready."""
        led = self.ledger
        if not self.pools:  # time 0: the plan's GPUs start ready, the rest start parked
            for name, shape in shapes.items():
                self.pools[name] = Pool(mode=pool_mode(name), shape=shape, idle_since=now)
            self.park(now, self.gpus - sum(sh.gpus for sh in shapes.values()))
        else:
            warm, cold = led.group_count(WARM), led.group_count(COLD)
            for name, pool in self.pools.items():
                if name not in shapes and (pool.shape.gpus or pool.joining or pool.next_shape is not None):
                    pool.retiring, pool.next_shape, pool.deficit = True, empty_like(pool.shape), 0
            for name, shape in shapes.items():
                pool = self.pools.setdefault(name, Pool(mode=pool_mode(name), shape=empty_like(shape), idle_since=now))
                pool.retiring = False
                pool.next_shape = shape
                need = shape.gpus - (pool.shape.gpus + pool.joining + pool.deficit)
                if need < 0:
                    pool.deficit -= min(pool.deficit, -need)
                elif need > 0:
                    from_warm = min(need, warm)
                    from_cold = min(need - from_warm, cold)
                    warm, cold = warm - from_warm, cold - from_cold
                    if from_warm or from_cold:
                        delay = self.profile.cold_rejoin_s(self.share_bytes(shape)) if from_cold else self.switch_delay
                        pool.joining += from_warm + from_cold
                        pool.next_at = max(pool.next_at, now + delay)
                        self.rejoins.append((now, from_warm + from_cold, "cold" if from_cold else "warm", delay))
                    pool.deficit += need - from_warm - from_cold
            self.parked(now, warm, cold)
            self.rejoin_group(now)
        for pool in self.pools.values():
            self.try_reshape(pool, now)

    def try_reshape(self, pool: Pool, now: float) -> None:
        """Take the planned shape when the pool is idle and every GPU it waits for is ready. The joiners
        move from the rejoin group into the pool; GPUs it no longer needs fill other pools' deficits
        (loading their new role's weights) or go to parking."""
        target = pool.next_shape
        if target is None or pool.pending is not None or now < pool.next_at or pool.deficit:
            return
        if pool.retiring and (pool.queue or pool.n_run or pool.waiting):
            return
        self.close_idle(pool, now)
        freed = pool.shape.gpus + pool.joining - target.gpus
        old = pool.shape
        pool.shape, pool.next_shape, pool.joining = target, None, 0
        if reshards(old, target):  # the GPUs it keeps load their new shards before it serves again
            stall_s = self.share_bytes(target) / self.profile.host_to_device_bytes_s
            self.charge(pool, now, now + stall_s, self.idle_w(pool) * stall_s)
            pool.pending, pool.busy_until = ([], 0), now + stall_s
            self.reshards.append((now, old.gpus, stall_s))
        for other in self.pools.values():
            if freed <= 0:
                break
            if other.deficit and other.next_shape is not None:
                moved = min(freed, other.deficit)
                freed -= moved
                other.deficit -= moved
                other.joining += moved
                delay = self.share_bytes(other.next_shape) / self.profile.host_to_device_bytes_s
                other.next_at = max(other.next_at, now + delay)
                self.rejoins.append((now, moved, "pool", delay))
        self.rejoin_group(now)
        if freed > 0:
            self.park(now, freed)

    def next_reshape_s(self, now: float) -> float:
        ready = [p.next_at for p in self.pools.values()
                 if p.next_shape is not None and p.pending is None and not p.deficit and p.next_at > now]
        return min(ready) if ready else math.inf


"""The simulator's energy books: every GPU of the cluster, in both accountings, one rule for every policy.

- `cluster`: all N GPUs from the start of the trace to the end of the run. GPUs outside the plan draw
  their parking state's power (warm: context kept, clock at the minimum; cold: bare idle).
- `active`: only GPUs in the plan (serving, idle in a pool, or rejoining it), and only from the first
  arrival on (the run ends at the last completion), as VoltanaLLM and ML.ENERGY measure.

Charges come in two forms: an iteration's energy over its span, and a group of GPUs drawing a
constant power over a stretch (`Group`: parked warm, parked cold, rejoining). GPU-seconds are kept
beside the joules so a test can check that every GPU is accounted for the whole run, exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Group:
    """GPUs outside the pools' books, all drawing the same power (W each) since `since`."""

    in_plan: bool
    count: int = 0
    watts_each: float = 0.0
    since: float = 0.0


@dataclass
class EnergyLedger:
    active_from_s: float = 0.0  # the first arrival: `active` leaves out what comes before
    record: bool = False
    cluster_j: float = 0.0
    active_j: float = 0.0
    cluster_gpu_s: float = 0.0
    active_gpu_s: float = 0.0
    parked_j: float = 0.0
    parked_gpu_s: float = 0.0
    rejoin_j: float = 0.0
    timeline: list[tuple[float, float, float]] = field(default_factory=list)  # (t0, t1, W) summed over GPUs
    groups: dict[str, Group] = field(default_factory=dict)

    def charge(self, t0: float, t1: float, gpus: int, joules: float, in_plan: bool = True) -> None:
        """`joules` spent by `gpus` GPUs over [t0, t1] (spread evenly over the span)."""
        span = t1 - t0
        if span <= 0:
            if joules:
                self.cluster_j += joules
                if in_plan and t0 >= self.active_from_s:
                    self.active_j += joules
            return
        self.cluster_j += joules
        self.cluster_gpu_s += gpus * span
        if self.record:
            self.timeline.append((t0, t1, joules / span))
        if in_plan:
            inside = max(0.0, t1 - max(t0, self.active_from_s)) / span
            self.active_j += joules * inside
            self.active_gpu_s += gpus * span * inside

    def power(self, t0: float, t1: float, gpus: int, watts_each: float, in_plan: bool = True) -> None:
        """`gpus` GPUs drawing `watts_each` over [t0, t1]."""
        if t1 > t0 and gpus:
            self.charge(t0, t1, gpus, gpus * watts_each * (t1 - t0), in_plan)

    def set_group(self, name: str, now: float, count: int, watts_each: float, in_plan: bool) -> None:
        """Close the group's stretch at its old size and power, then hold `count` GPUs at `watts_each`."""
        g = self.groups.setdefault(name, Group(in_plan, since=now))
        before = self.cluster_j
        self.power(g.since, now, g.count, g.watts_each, g.in_plan)
        spent = self.cluster_j - before
        if name.startswith("parked"):
            self.parked_j += spent
            self.parked_gpu_s += g.count * max(0.0, now - g.since)
        elif name.startswith("rejoin"):
            self.rejoin_j += spent
        g.count, g.watts_each, g.since, g.in_plan = count, watts_each, now, in_plan

    def close(self, now: float) -> None:
        for name, g in list(self.groups.items()):
            self.set_group(name, now, g.count, g.watts_each, g.in_plan)

    def group_count(self, name: str) -> int:
        g = self.groups.get(name)
        return g.count if g is not None else 0

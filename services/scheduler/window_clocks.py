"""Clock planning for the frequency commands: pure functions, no I/O, no clock of their own.

The `max`, `fixed` and `slo` rules (`plan_clocks`, one call per worker per window); `aflex` is planned
by aflex.py and falls back to `slo` where a worker's GPU profile or the model's shape is unknown.
A clock is always one of the worker's supported clocks. The rules in words: docs/architecture.md,
"Clock policies".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from shared.gpu.snap import snap_clock
from shared.kinds import CLOCK_PHASES, ClockPhase, Role

ClockPolicy = Literal["aflex", "max", "fixed", "slo"]
ROLES: tuple[Role, ...] = get_args(Role)


@dataclass(frozen=True)
class PhaseSignal:
    """What was observed of one phase's SLO metric in the last window."""

    p90_ms: float | None  # None: nothing observed
    slo_ms: float
    misses: int = 0  # requests (finished or still running) already over the SLO
    count: int = 0  # observations (misses included), for the miss fraction


@dataclass(frozen=True)
class SloRule:
    low: float = 0.7  # step down while p90 < low * SLO
    high: float = 0.9  # step up when p90 > high * SLO (or on any miss)
    down_steps: int = 2
    up_steps: int = 4


def parse_fixed_clocks(spec: str) -> dict[tuple[Role, ClockPhase], int]:
    """`"attention.decode=900, ffn=1200"` -> {("attention", "decode"): 900, ("ffn", "prefill"): 1200, ...}.

    A bare role sets both phases; a `role.phase` entry overrides it whatever the order.
    """
    out: dict[tuple[Role, ClockPhase], int] = {}
    specific: dict[tuple[Role, ClockPhase], int] = {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        role, _, phase = key.strip().partition(".")
        if not sep or role not in ROLES or (phase and phase not in CLOCK_PHASES):
            raise ValueError(f"fixed clock {item!r}: expected role[.phase]=MHz with role in {ROLES} "
                             f"and phase in {CLOCK_PHASES}")
        try:
            mhz = int(value.strip())
        except ValueError:
            raise ValueError(f"fixed clock {item!r}: {value.strip()!r} is not an integer MHz") from None
        if mhz <= 0:
            raise ValueError(f"fixed clock {item!r}: MHz must be positive")
        if phase:
            specific[(role, phase)] = mhz  # type: ignore[index]
        else:
            for p in CLOCK_PHASES:
                out[(role, p)] = mhz  # type: ignore[index]
    out.update(specific)
    return out


def _table(supported: Iterable[int]) -> list[int]:
    table = sorted({int(c) for c in supported if c > 0})
    if not table:
        raise ValueError("no supported clocks")
    return table


def step(supported: Iterable[int], current: int, steps: int) -> int:
    """Move `steps` supported clocks up (> 0) or down (< 0) from `current`, clamped to the table."""
    table = _table(supported)
    i = table.index(snap_clock(table, current, "down"))
    return table[min(max(i + steps, 0), len(table) - 1)]


def slo_direction(signal: PhaseSignal, rule: SloRule = SloRule()) -> int:
    """+1 (up), -1 (down) or 0 (hold) for one phase."""
    if signal.misses > 0:
        return 1
    if signal.p90_ms is None or signal.slo_ms <= 0:
        return 0
    if signal.p90_ms > rule.high * signal.slo_ms:
        return 1
    if signal.p90_ms < rule.low * signal.slo_ms:
        return -1
    return 0


def plan_clocks(policy: ClockPolicy, role: Role, supported: Sequence[int],
                previous: Mapping[ClockPhase, int] | None = None,
                signals: Mapping[ClockPhase, PhaseSignal] | None = None,
                fixed: Mapping[tuple[Role, ClockPhase], int] | None = None,
                rule: SloRule = SloRule()) -> tuple[dict[ClockPhase, int], str]:
    """The per-phase clocks of one worker for the next window, and a short reason."""
    table = _table(supported)
    top = table[-1]
    if policy == "max":
        return {p: top for p in CLOCK_PHASES}, "max"
    if policy == "fixed":
        fixed = fixed or {}
        return {p: snap_clock(table, fixed.get((role, p), top), "down") for p in CLOCK_PHASES}, "fixed"
    if policy != "slo":
        raise ValueError(f"unknown clock policy {policy!r} (aflex is planned by services.scheduler.aflex)")
    if previous is None:
        return {p: top for p in CLOCK_PHASES}, "slo: start at max"
    signals = signals or {}
    clocks: dict[ClockPhase, int] = {}
    why = []
    for p in CLOCK_PHASES:
        current = snap_clock(table, previous.get(p, top), "down")
        sig = signals.get(p)
        direction = slo_direction(sig, rule) if sig is not None else 0
        steps = rule.up_steps if direction > 0 else -rule.down_steps if direction < 0 else 0
        clocks[p] = step(table, current, steps)
        word = {1: "up", -1: "down", 0: "hold"}[direction]
        if sig is not None and sig.p90_ms is not None:
            why.append(f"{p} p90 {sig.p90_ms:.1f}/{sig.slo_ms:.0f} ms, {sig.misses} missed: {word}")
        else:
            why.append(f"{p} {sig.misses if sig else 0} missed: {word}")
    return clocks, "slo: " + "; ".join(why)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in 0..100; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

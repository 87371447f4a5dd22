"""Snapping a requested clock to a table of clocks a GPU supports, with the rounding said out loud.

Every place that turns a wanted clock into one a GPU (or a predictor's table) has uses this one
function: "down" (the highest clock at or below it: a cap), "up" (the lowest at or above it: a floor
that still meets a latency budget), "nearest" (ties go down). Outside the table's range it clamps.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Literal, TypeVar

Rounding = Literal["down", "up", "nearest"]
C = TypeVar("C", int, float)


def snap_clock(table_mhz: Sequence[C], clock_mhz: float, rounding: Rounding) -> C:
    """The entry of ascending `table_mhz` that `clock_mhz` rounds to (clamped to the table's range)."""
    if len(table_mhz) == 0:
        raise ValueError("no supported clocks to snap to")
    if rounding == "down":
        return table_mhz[max(bisect.bisect_right(table_mhz, clock_mhz) - 1, 0)]
    i = bisect.bisect_left(table_mhz, clock_mhz)
    if rounding == "up":
        return table_mhz[min(i, len(table_mhz) - 1)]
    if rounding != "nearest":
        raise ValueError(f"rounding must be 'down', 'up' or 'nearest', got {rounding!r}")
    if i <= 0:
        return table_mhz[0]
    if i >= len(table_mhz):
        return table_mhz[-1]
    below, above = table_mhz[i - 1], table_mhz[i]
    return below if clock_mhz - below <= above - clock_mhz else above

"""The running-set bound: how many sequences one attention worker runs at once, from its own steps.

A feedback loop on the step time the running requests see (their TPOT): while the recent steps
(median of the last `RECENT_STEPS`) take longer than a target, no sequence starts until finished ones
bring the set down; while the last step passed it, the set holds; while it took less, the set may
grow to the last step's size scaled by target / step. A step's cost is concave in the set and has a
fixed part, so the scaled size never overshoots, and an idle worker's burst is taken in a step or two.
The target (`running_bound`):
- "auto" (the default): `tpot_slo_ms` when it is at least twice the unloaded step (a GPU, where a
  step grows slowly with the set: the SLO holds many sequences), else none (a CPU, where the SLO
  holds one or two: `max_num_seqs` bounds the step instead, and holding the SLO would give up most
  of the throughput);
- "slo": `tpot_slo_ms` whatever it costs;
- "off": `max_num_seqs` only.
The unloaded step is the shortest step seen. A knee target (ten unloaded steps: 90% of a linear
cost's throughput) was tried and measured: the cost is concave here, so it gave up 40% of the served
requests for 31% off TPOT (docs/reliability.md, "Overload").
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Literal

RunningBoundMode = Literal["auto", "slo", "off"]

RECENT_STEPS = 8  # the steps whose median is compared with the target
SLO_MIN_FACTOR = 2.0  # "auto" keeps to the SLO while it is at least this many unloaded steps


class RunningBound:
    """One attention worker's recent steps, and how large its running set may be for the next one."""

    def __init__(self, tpot_slo_s: float, mode: RunningBoundMode = "auto") -> None:
        self.tpot_slo_s, self.mode = tpot_slo_s, mode
        self._recent: deque[tuple[int, float]] = deque(maxlen=RECENT_STEPS)  # (sequences decoding, seconds)
        self.unloaded_s: float | None = None  # the shortest step seen

    def step(self, n_decode: int, step_s: float) -> None:
        """An iteration fed `n_decode` sequences a token each (and maybe prompt chunks) in `step_s`."""
        if n_decode <= 0 or step_s <= 0.0:
            return
        self._recent.append((n_decode, step_s))
        self.unloaded_s = step_s if self.unloaded_s is None else min(self.unloaded_s, step_s)

    @property
    def target_s(self) -> float | None:
        """The step time the bound holds the running set to (None: no bound, or nothing seen yet)."""
        if self.mode == "off" or self.unloaded_s is None:
            return None
        if self.mode == "slo" or self.tpot_slo_s >= SLO_MIN_FACTOR * self.unloaded_s:
            return self.tpot_slo_s
        return None

    def bound(self, n_running: int) -> int | None:
        """The most sequences to run in the next iteration, now `n_running` run (None: no bound but
        `max_num_seqs`: nothing runs, or fewer than `RECENT_STEPS` steps were seen)."""
        target_s = self.target_s
        if target_s is None or len(self._recent) < RECENT_STEPS or n_running == 0:
            return None
        if statistics.median(s for _, s in self._recent) > target_s:
            return max(1, n_running - 1)  # no new sequence until finished ones bring it down
        n_last, last_s = self._recent[-1]
        if last_s > target_s:  # the last step passed it (prompts just admitted, say): hold
            return n_running
        # scaled to the target: a step's cost is concave in the set with a fixed part, so this never overshoots
        return max(n_running + 1, math.floor(n_last * target_s / last_s))

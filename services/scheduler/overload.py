"""The TPOT guard: while requests wait, may an attention worker's running set grow?

A worker takes no more sequences into its running set once its steps (iterations with decodes in
them: a token of each running sequence) take longer than `tpot_slo_ms` (p90 of the last few), as
long as it has run within that SLO with a running set at least this large lately. If it never has,
the SLO is out of its reach at any size and it runs for throughput, up to `max_num_seqs`. Off by
default (`tpot_guard`): on a CPU, where the SLO is met only by one or two sequences, it gives up most
of the throughput (docs/reliability.md, "Overload"). Fed by dispatch; time is passed in.
"""

from __future__ import annotations

from collections import deque

GUARD_STEPS = 8  # the decode steps whose 90th percentile is compared with the SLO
GUARD_MEMORY_S = 60.0  # how long a step within the SLO vouches for its running-set size


class RunningGuard:
    """One attention worker's decode steps against the TPOT SLO: may its running set grow?"""

    def __init__(self, tpot_slo_s: float) -> None:
        self.tpot_slo_s = tpot_slo_s
        self._steps: deque[float] = deque(maxlen=GUARD_STEPS)  # seconds per decode step, latest last
        self._within: deque[tuple[float, int]] = deque()  # (monotonic, running set) of steps within the SLO

    def step(self, now: float, n_running: int, step_s: float) -> None:
        """An iteration with `n_running` sequences decoding took `step_s` (one token each)."""
        self._steps.append(step_s)
        if step_s <= self.tpot_slo_s:
            self._within.append((now, n_running))
        while self._within and now - self._within[0][0] > GUARD_MEMORY_S:
            self._within.popleft()

    def full(self, now: float, n_running: int) -> bool:
        """True when no more sequences should start: its recent steps (p90) are over the SLO and it has
        met the SLO lately with as many running (or more)."""
        if len(self._steps) < GUARD_STEPS or n_running == 0:
            return False
        ordered = sorted(self._steps)
        p90_s = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        if p90_s <= self.tpot_slo_s:
            return False
        while self._within and now - self._within[0][0] > GUARD_MEMORY_S:
            self._within.popleft()
        largest_within = max((n for _, n in self._within), default=0)
        return largest_within > 0 and n_running >= largest_within

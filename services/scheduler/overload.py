"""Overload, measured: how long a new request would wait to start, and when a worker's running set is full.

When more arrives than the mesh serves, two bounds keep a served request's latency:

- **The waiting queue** (`QueueDrain`). A request is refused (429) when the requests waiting ahead
  of it would take longer than `max_queue_wait_s` to start, at the rate requests left the queue
  while it was never empty. That rate is the mesh's capacity only while it is saturated, so it is
  measured only then: a burst after an idle spell has no rate yet and is let in (up to `max_queue`).
- **The running set** (`RunningGuard`, one per attention worker). While requests wait, a worker takes
  no more sequences into its running set once its steps (iterations with decodes in them: a token
  of each running sequence) take longer than `tpot_slo_ms`, as
  long as it has run within that SLO with a running set at least this large lately. If it never
  has, the SLO is out of its reach at any size and it runs for throughput, up to `max_num_seqs`.

Both are fed by dispatch and answer without I/O (time is passed in).
"""

from __future__ import annotations

from collections import deque

DRAIN_WINDOW_S = 10.0  # the start rate covers this much of the current saturated spell
DRAIN_MIN_SPAN_S = 2.0  # a spell shorter than this has no rate yet
DRAIN_MIN_STARTED = 4  # nor one in which fewer requests started
GUARD_STEPS = 8  # the decode steps whose 90th percentile is compared with the SLO
GUARD_MEMORY_S = 60.0  # how long a step within the SLO vouches for its running-set size


class QueueDrain:
    """The rate requests leave the waiting queue while it stays non-empty, and the wait it implies."""

    def __init__(self) -> None:
        self._busy_since: float | None = None  # monotonic: the queue has not been empty since
        self._starts: deque[tuple[float, int]] = deque()  # (monotonic, requests started) in this spell

    def _queue(self, now: float, waiting: int) -> None:
        if waiting == 0:
            self._busy_since = None
            self._starts.clear()
        elif self._busy_since is None:
            self._busy_since = now

    def started(self, now: float, n: int, waiting_after: int) -> None:
        """`n` requests went from waiting into a running set; `waiting_after` still wait."""
        if self._busy_since is not None and n > 0:
            self._starts.append((now, n))
        self._queue(now, waiting_after)

    def wait_s(self, now: float, waiting: int) -> float | None:
        """How long a request arriving now would wait to start behind `waiting` others; None: not
        measured (the queue was empty lately, or has not been busy long enough to say)."""
        self._queue(now, waiting)
        if self._busy_since is None:
            return 0.0
        while self._starts and now - self._starts[0][0] > DRAIN_WINDOW_S:
            self._starts.popleft()
        span_s = now - max(self._busy_since, now - DRAIN_WINDOW_S)
        started = sum(n for _, n in self._starts)
        if span_s < DRAIN_MIN_SPAN_S or started < DRAIN_MIN_STARTED:
            return None
        return waiting / (started / span_s)


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

"""The SLOs as the scheduler sees them: the first tokens and finished requests of the last window.

Kept apart from what reads it: the clock governor steers by the window's TTFT and TPOT (`signals`),
the telemetry reports SLO attainment and the p90s (`figures`); dispatch tells it each first token and
each end. TTFT and TPOT are vLLM's benchmark definitions (`RequestState.ttft_s`, `tpot_s`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from services.scheduler.state import RequestState
from services.scheduler.window_clocks import PhaseSignal, percentile
from shared.kinds import ClockPhase, FinishReason
from shared.settings import SchedulerSettings


@dataclass(frozen=True)
class Finished:
    """A finished request, kept for a window for SLO attainment and the clock feedback."""

    mono: float  # time.monotonic() when it finished
    reason: FinishReason
    ttft_ms: float | None
    tpot_ms: float | None


@dataclass(frozen=True)
class SloFigures:
    """The telemetry's SLO figures over the finished requests of the window (`SloWatch.window_s`)."""

    finished: int  # requests finished since the scheduler started
    attainment: float | None  # the share that met both SLOs (None: none finished in the window)
    ttft_p90_ms: float | None
    tpot_p90_ms: float | None


class SloWatch:
    """First tokens and finished requests, kept for `window_s`."""

    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        self.finished_total = 0
        self.finished_log: deque[Finished] = deque()
        self.ttft_log: deque[tuple[float, float]] = deque()  # (monotonic time of the first token, TTFT ms)

    def first_token(self, mono: float, ttft_ms: float) -> None:
        self.ttft_log.append((mono, ttft_ms))

    def finished(self, state: RequestState, reason: FinishReason, mono: float) -> None:
        self.finished_total += 1
        ttft, tpot = state.ttft_s, state.tpot_s
        self.finished_log.append(Finished(mono, reason, None if ttft is None else ttft * 1000.0,
                                          None if tpot is None else tpot * 1000.0))

    @property
    def window_s(self) -> float:
        """SLO attainment and p90s cover requests finished within this many seconds: a frequency window, or
        a telemetry period where that is longer."""
        hz = self.settings.telemetry_hz
        return max(self.settings.freq_window_s, 1.0 / hz if hz > 0 else 0.0)

    def _prune(self, now: float) -> None:
        keep = self.window_s
        while self.finished_log and now - self.finished_log[0].mono > keep:
            self.finished_log.popleft()
        while self.ttft_log and now - self.ttft_log[0][0] > keep:
            self.ttft_log.popleft()

    def signals(self, now: float, requests: Iterable[RequestState]) -> dict[ClockPhase, PhaseSignal]:
        """TTFT (prefill) and TPOT (decode) seen in the last frequency window, for the clock planner.

        TTFT: every first token of the window; a request still waiting for its first token longer
        than the SLO counts as a miss. TPOT: requests finished in the window, and running ones that
        streamed in it (their TPOT so far), so long requests steer the clocks before they end.
        """
        self._prune(now)
        window = self.settings.freq_window_s
        ttft_slo, tpot_slo = self.settings.ttft_slo_ms, self.settings.tpot_slo_ms
        ttfts = [ms for t, ms in self.ttft_log if now - t <= window]
        tpots = [f.tpot_ms for f in self.finished_log if now - f.mono <= window and f.tpot_ms is not None]
        ttft_miss = sum(ms > ttft_slo for ms in ttfts)
        unix = time.time()
        for state in requests:
            if state.first_token_ts is None:
                ttft_miss += (unix - state.arrival_ts) * 1000.0 > ttft_slo
            elif state.last_token_ts is not None and unix - state.last_token_ts <= window:
                tpot = state.tpot_s
                if tpot is not None:
                    tpots.append(tpot * 1000.0)
        tpot_miss = sum(ms > tpot_slo for ms in tpots)
        ttft_count = len(ttfts) + ttft_miss - sum(ms > ttft_slo for ms in ttfts)  # late waiters count too
        return {"prefill": PhaseSignal(percentile(ttfts, 90), ttft_slo, ttft_miss, ttft_count),
                "decode": PhaseSignal(percentile(tpots, 90), tpot_slo, tpot_miss, len(tpots))}

    def figures(self, now: float) -> SloFigures:
        """SLO attainment and the p90s over the window's finished requests (a client's cancel is no miss)."""
        self._prune(now)
        ttft_slo, tpot_slo = self.settings.ttft_slo_ms, self.settings.tpot_slo_ms
        done = [f for f in self.finished_log if f.reason != "abort"]
        good = sum(f.reason != "error" and f.ttft_ms is not None and f.ttft_ms <= ttft_slo
                   and (f.tpot_ms or 0.0) <= tpot_slo for f in done)
        return SloFigures(self.finished_total, good / len(done) if done else None,
                          percentile([f.ttft_ms for f in done if f.ttft_ms is not None], 90),
                          percentile([f.tpot_ms for f in done if f.tpot_ms is not None], 90))

"""The simulator's per-iteration controller: `choose_operating_point` memoised on quantised batch statistics.

A one-hour trace runs hundreds of thousands of iterations whose batches repeat closely; quantising
the statistics (16 steps per octave of tokens, 12 of context) and caching the decision keeps a
replay in seconds. Decisions are deterministic, so the cache never changes a result for a seed.
"""

from __future__ import annotations

import math
from typing import Any

from shared.perf import Predictor
from shared.policy import BatchStats, ClockRule, OperatingPoint, PoolShape, choose_operating_point


class Controller:
    """Memoised `choose_operating_point` on quantised batch statistics (decisions are deterministic)."""

    def __init__(self, pred: Predictor, rule: ClockRule) -> None:
        self.pred, self.rule = pred, rule
        self.cache: dict[tuple[Any, ...], OperatingPoint] = {}

    @staticmethod
    def _q(x: float, per_octave: int) -> int:
        return round(per_octave * math.log2(x + 1.0))

    @staticmethod
    def _dq(k: int, per_octave: int) -> float:
        return float(2.0 ** (k / per_octave) - 1.0)

    def plan(self, shape: PoolShape, s: BatchStats, budget_s: float, current: OperatingPoint | None,
             rule: ClockRule | None = None, next_prompt_rate_hz: float = 0.0) -> OperatingPoint:
        qn, qc = self._q(s.n_tokens, 16), self._q(s.ctx_tokens, 12)
        qp, qs = self._q(s.pairs, 8), self._q(s.n_sample, 16)
        # the single-sequence bound only matters when that sequence is more than one group's share
        big = s.seq_tokens > s.n_tokens / max(1, shape.units)
        sq = (self._q(s.seq_tokens, 16), self._q(s.seq_ctx, 12), self._q(s.seq_pairs, 8)) if big else (0, 0, 0)
        qb = int(budget_s * 400)  # 2.5 ms
        cur = (current.depth, current.index) if current is not None else None
        rule = self.rule if rule is None else rule
        qr = self._q(next_prompt_rate_hz * 100.0, 8) if next_prompt_rate_hz > 0 else -1  # 8 per octave
        key = (shape, s.phase, qn, qc, qp, qs, sq, qb, cur, rule, qr)
        op = self.cache.get(key)
        if op is None:
            seq = (self._dq(sq[0], 16), self._dq(sq[1], 12), self._dq(sq[2], 8)) if big else (0.0, 0.0, 0.0)
            rep = BatchStats(s.phase, self._dq(qn, 16), self._dq(qc, 12), self._dq(qp, 8), self._dq(qs, 16), *seq)
            rate = self._dq(qr, 8) / 100.0 if qr >= 0 else 0.0
            op = choose_operating_point(self.pred, shape, rep, qb / 400.0, rule, current, rate)
            if len(self.cache) > 200_000:
                self.cache.clear()
            self.cache[key] = op
        return op

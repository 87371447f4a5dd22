"""The simulator's per-iteration controller: `choose_operating_point` memoised on quantised batch statistics.

A one-hour trace runs hundreds of thousands of iterations whose batches repeat closely; quantising
the statistics (16 steps per octave of tokens, 12 of context) and caching the decision keeps a
replay in seconds. Decisions are deterministic, so the cache never changes a result for a seed.
The candidates of a batch (`point_tables`) are kept apart from the budget and the current point that
pick among them (`select_point`): the same batch comes back under other budgets, and building the
candidates is most of a decision's cost.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

from shared.perf import Predictor
from shared.policy import BatchStats, ClockRule, OperatingPoint, PoolShape
from shared.policy.iteration import AUTO_PLANNER_DEPTHS
from shared.policy.operating_point import PointTables, point_tables, select_point

MAX_DEPTH = max(AUTO_PLANNER_DEPTHS)  # the deepest cut a planner considers

TABLES_KEPT = 1024  # a scanning rule's tables are ~80 KB (4 depths x 28 x 28 clocks); ~55% of misses hit


class Controller:
    """Memoised `choose_operating_point` on quantised batch statistics (decisions are deterministic)."""

    def __init__(self, pred: Predictor, rule: ClockRule) -> None:
        self.pred, self.rule = pred, rule
        self.cache: dict[tuple[Any, ...], OperatingPoint] = {}
        # each batch's candidates, least recently used dropped first (`TABLES_KEPT`)
        self.tables: OrderedDict[tuple[Any, ...], PointTables] = OrderedDict()

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
        # the single-sequence bounds only matter when that sequence is more than an even microbatch's share
        big = s.seq_tokens > s.n_tokens / (max(1, shape.units) * MAX_DEPTH)
        qk = min(s.group_seqs(shape.units), MAX_DEPTH)  # the depths a group's sequences allow
        few = s.busy_units(shape.units) if s.seqs < shape.units else 0  # fewer sequences than groups: exact
        sq = (self._q(s.seq_tokens, 16), self._q(s.seq_ctx, 12), self._q(s.seq_pairs, 8)) if big else (0, 0, 0)
        qb = int(budget_s * 400)  # 2.5 ms
        cur = (current.depth, current.index) if current is not None else None
        rule = self.rule if rule is None else rule
        qr = self._q(next_prompt_rate_hz * 100.0, 8) if next_prompt_rate_hz > 0 else -1  # 8 per octave
        key = (shape, s.phase, qn, qc, qp, qs, sq, qk, few, qb, cur, rule, qr)
        op = self.cache.get(key)
        if op is None:
            seq = (self._dq(sq[0], 16), self._dq(sq[1], 12), self._dq(sq[2], 8)) if big else (0.0, 0.0, 0.0)
            rep = BatchStats(s.phase, self._dq(qn, 16), self._dq(qc, 12), self._dq(qp, 8), self._dq(qs, 16), *seq,
                             n_seqs=few or qk * max(1, shape.units))
            rate = self._dq(qr, 8) / 100.0 if qr >= 0 else 0.0
            tkey = (shape, s.phase, qn, qc, qp, qs, sq, qk, few, rule, qr)
            tables = self.tables.get(tkey)
            if tables is None:
                tables = self.tables[tkey] = point_tables(self.pred, shape, rep, rule, rate)
                if len(self.tables) > TABLES_KEPT:
                    self.tables.pop(next(iter(self.tables)))
            else:
                self.tables.move_to_end(tkey)
            op = select_point(self.pred, tables, qb / 400.0, rule, current)
            if len(self.cache) > 200_000:
                self.cache.clear()
                self.tables.clear()
            self.cache[key] = op
        return op

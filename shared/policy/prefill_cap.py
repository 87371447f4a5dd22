"""The prefill cap: how many prefill tokens one iteration takes, and the TTFT budget its queue sets.

The live planner (`services.scheduler.aflex`) and the simulator (`loadgen.sim.engine`) price a candidate
chunk the same way: its iteration beside the running decodes, at the top clocks (`AT_MAX`), handed to
`prefill_budget`; and they bound an iteration by the TTFT deadlines of the first `QUEUE_HORIZON`
queued requests. Both ask with the iteration former's `PrefillQuery` and pass their own pricing
(`time_of`); the rest is here once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from itertools import islice

from shared.perf import causal_pairs
from shared.policy.batching import BatchingRule, prefill_budget, ttft_budget
from shared.policy.iteration import PrefillQuery
from shared.policy.operating_point import BatchStats, ClockRule

AT_MAX = ClockRule(max_clock=True, depths=(1,))  # the prefill cap's "time at the top clock"
QUEUE_HORIZON = 32  # queued requests whose TTFT deadlines bound an iteration's time


def prefill_stats_at(tokens: int, n_decode: int = 0, decode_ctx: float = 0.0, head_tokens: int | None = None,
                     share: int = 1) -> BatchStats:
    """An iteration of `tokens` fresh prefill tokens (one sequence's chunk at most `head_tokens`) beside
    `n_decode` decode sequences holding `decode_ctx` tokens of context, times `share` such workers."""
    k = max(1, share)
    q1 = float(tokens if head_tokens is None else min(tokens, head_tokens))
    n = float(n_decode + tokens)
    ctx = decode_ctx + n
    pairs = decode_ctx + n_decode + tokens * tokens / 2.0
    prompts = math.ceil(tokens / q1) if q1 > 0 else 0  # the fewest sequences holding them: the fewest microbatches
    return BatchStats("prefill", n * k, ctx * k, pairs * k, float(n_decode + 1) * k, q1, q1, causal_pairs(q1, q1),
                      n_seqs=float(n_decode + max(1, prompts)) * k)


def prefill_cap(rule: BatchingRule, query: PrefillQuery, time_of: Callable[[BatchStats], float], *,
                share: int = 1, tpot_budget_s: float, ttft_slo_s: float, units: int = 1) -> int:
    """Prefill tokens for one iteration (`prefill_budget`), a candidate priced by `time_of` (its time at
    `AT_MAX`) on `prefill_stats_at`; a prefill-only iteration is bounded by `prefill_iter_frac` of the TTFT SLO,
    and a prompt waiting past the TTFT SLO (`query.oldest_wait_s`) makes the queue `overdue`."""
    iter_s = rule.prefill_iter_frac * ttft_slo_s

    def time_at_max(tokens: int) -> float:
        return time_of(prefill_stats_at(tokens, query.n_decode, query.decode_ctx_tokens, query.head_tokens, share))

    return prefill_budget(rule, query.queued_tokens, query.n_decode,
                          time_at_max if query.n_decode or iter_s > 0 else None, tpot_budget_s, units=units,
                          prefill_iter_s=iter_s, overdue=query.oldest_wait_s > ttft_slo_s)


def queue_ttft_budget(now: float, queue: Iterable[tuple[float, float]], ttft_budget_s: float,
                      chunk_tokens: float, lead_tokens: float | None = None) -> float:
    """`ttft_budget` over the first `QUEUE_HORIZON` of `queue` ((arrival, prefill tokens) in serving order),
    each due `ttft_budget_s` after its arrival; `lead_tokens`: a fresh request arriving now, ahead of them."""
    deadlines: list[float] = []
    ahead: list[float] = []
    if lead_tokens is not None:
        deadlines.append(now + ttft_budget_s)
        ahead.append(lead_tokens)
    acc = 0.0
    for arrival, tokens in islice(queue, QUEUE_HORIZON):
        acc += tokens
        deadlines.append(arrival + ttft_budget_s)
        ahead.append(acc)
    return ttft_budget(now, deadlines, ahead, chunk_tokens)

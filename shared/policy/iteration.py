"""One iteration former, shared by the live scheduler, the in-process engine and the simulator. Pure.

The simulator's latency and energy figures say something about the mesh only if it forms iterations
as the scheduler does, and the engine is the token reference for both; so all three form an
iteration (which sequences, how many tokens each) and cut it into microbatches with this code.
What stays with each caller is what only it has: KV reservation and preemption (the engine, from a
form it applies in order), KV estimates (the scheduler's `can_admit`), and the decode batch as one
aggregate (the simulator, which forms only its prefill chunk here).

An iteration, in order: decode steps first (`decodes`), then the prefill work (`queue`: unfinished
prefills and waiting requests), in the rule's order (`shared.policy.prefill_order`), within the
token budget and, with `prefill_cap`, at most that many prefill tokens. Waiting requests are
admitted while `max_num_seqs` and `can_admit` allow; admission stops at the first refusal, so a
request that has aged to the front is not overtaken while it waits for room, and admitted work
goes on. The engine's first-come first-served rule is the same walk with every running sequence
in `queue`, in its order, and no rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from shared.policy.batching import BatchingRule, prefill_order

K = TypeVar("K")

# (prefill tokens queued, the remaining tokens of the first in serving order) -> most prefill tokens
PrefillCap = Callable[[int, int], int]

AUTO_DEPTH_MIN_SEQS = 4  # below this many sequences overlap cannot pay: depth 1 (as the paper found)


@dataclass(frozen=True)
class WorkItem(Generic[K]):
    """One sequence as the former sees it; `key` is the caller's handle (its state object, an id)."""

    key: K
    remaining_tokens: int  # tokens not yet fed (1 for a decode step)
    arrival_s: float = 0.0  # on the clock of `now_s`: only the rule's aging reads it
    is_waiting: bool = False  # not admitted yet: must pass `max_num_seqs` and `can_admit`


@dataclass(frozen=True)
class Feed(Generic[K]):
    """`n_tokens` of `item` fed in this iteration."""

    item: WorkItem[K]
    n_tokens: int

    @property
    def key(self) -> K:
        return self.item.key

    @property
    def completes(self) -> bool:
        """The feed reaches the item's last known token (a prefill that ends, a decode step)."""
        return self.n_tokens == self.item.remaining_tokens


@dataclass(frozen=True)
class IterationForm(Generic[K]):
    feeds: tuple[Feed[K], ...]  # decode steps first, then the prefill work in serving order
    admitted: tuple[K, ...]  # the waiting items it admits, in order (each has a feed)

    @property
    def n_tokens(self) -> int:
        return sum(f.n_tokens for f in self.feeds)


def form_iteration(decodes: Iterable[WorkItem[K]], queue: Iterable[WorkItem[K]], *, token_budget: int,
                   max_num_seqs: int | None = None, running_count: int = 0, rule: BatchingRule | None = None,
                   now_s: float = 0.0, prefill_cap: PrefillCap | None = None, seq_cap: int | None = None,
                   can_admit: Callable[[K], bool] | None = None) -> IterationForm[K]:
    """The sequences of one iteration and the tokens each feeds (module docstring for the rule).

    `running_count` sequences already hold a place toward `max_num_seqs` (None: no limit); `rule`
    (None: queue order) orders the queue at `now_s`; `prefill_cap` bounds the queue's tokens once
    the decode steps are in; `seq_cap` bounds one queue item's tokens (a chunked-prefill chunk).
    Items with nothing to feed are skipped. The simulator forms its prefill chunk from its queue,
    already in serving order, with no decodes and nothing waiting (every item is fed, none admitted)::

        items = [WorkItem(rid, rem) for rid, rem in pool.queue]
        form = form_iteration((), items, token_budget=take, seq_cap=seq_chunk_cap(rule, take))
        chunk = [(f.key, f.n_tokens) for f in form.feeds]  # q = min(rem, left, cap), in queue order
    """
    if seq_cap is not None and seq_cap < 1:
        raise ValueError(f"seq_cap must be at least 1 token, got {seq_cap}")
    feeds: list[Feed[K]] = []
    budget = token_budget
    for item in decodes:
        if budget <= 0:
            break
        if item.remaining_tokens > 0:
            feeds.append(Feed(item, min(item.remaining_tokens, budget)))
            budget -= feeds[-1].n_tokens
    work = [i for i in queue if i.remaining_tokens > 0]
    if rule is not None and len(work) > 1:
        order = prefill_order(rule, now_s, [i.arrival_s for i in work], [float(i.remaining_tokens) for i in work])
        work = [work[k] for k in order]
    if prefill_cap is not None and work:
        budget = min(budget, max(0, prefill_cap(sum(i.remaining_tokens for i in work), work[0].remaining_tokens)))
    per_item = token_budget if seq_cap is None else seq_cap
    admitted: list[K] = []
    admitting = True
    for item in work:
        if budget <= 0:
            break
        if item.is_waiting:
            if not admitting:
                continue
            full = max_num_seqs is not None and running_count + len(admitted) >= max_num_seqs
            if full or (can_admit is not None and not can_admit(item.key)):
                admitting = False  # no later waiting item overtakes it; admitted work goes on
                continue
            admitted.append(item.key)
        n_tokens = min(item.remaining_tokens, budget, per_item)
        feeds.append(Feed(item, n_tokens))
        budget -= n_tokens
    return IterationForm(tuple(feeds), tuple(admitted))


def microbatch_depth(setting: str, n_seqs: int) -> int:
    """`"1"`, `"2"`, ... fixed; `"auto"`: 1 below AUTO_DEPTH_MIN_SEQS sequences, else 2. Never more than
    n_seqs (a microbatch needs a sequence), never less than 1."""
    if setting == "auto":
        depth = 1 if n_seqs < AUTO_DEPTH_MIN_SEQS else 2
    elif setting.isdecimal() and int(setting) >= 1:
        depth = int(setting)
    else:
        raise ValueError(f"microbatch depth must be 'auto' or a whole number of at least 1, got {setting!r}")
    return max(1, min(depth, n_seqs))


def split_microbatches(token_counts: Sequence[int], depth: int) -> list[range]:
    """Index ranges cutting sequences (their tokens this iteration, in order) into at most `depth`
    contiguous, non-empty groups of about equal tokens.

    Contiguous so a microbatch is a slice of the iteration; every group gets at least one sequence
    when there are enough, so depth 2 of a long prefill beside a decode step still pipelines.
    """
    if depth < 1:
        raise ValueError(f"microbatch depth must be at least 1, got {depth}")
    n = len(token_counts)
    if n == 0:
        return []
    depth = min(depth, n)
    total = sum(token_counts)
    starts = [0]
    done = 0
    for index, tokens in enumerate(token_counts):
        later = depth - len(starts)  # groups still to open after the current one
        if index > starts[-1] and later > 0 and (done * depth >= len(starts) * total or n - index <= later):
            starts.append(index)
        done += tokens
    return [range(a, b) for a, b in zip(starts, [*starts[1:], n], strict=True)]

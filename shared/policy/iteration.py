"""One iteration former, shared by the live scheduler, the in-process engine and the simulator. Pure.

The simulator's figures say something about the mesh only if it forms iterations as the scheduler
does, and the engine is the token reference for both; so all three form an iteration (which
sequences, how many tokens each) and cut it into microbatches with this code. `plan_iteration` is
the scheduler's whole decision for one worker (form, microbatch cut, depth) in one pure call.
The walk's order and admission rule: docs/architecture.md, "One iteration former".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, Literal, TypeVar

from shared.kinds import ClockPhase, Phase, clock_phase
from shared.policy.batching import BatchingRule, prefill_order

K = TypeVar("K")

FCFS = BatchingRule(order="fcfs")  # no rule: queue order, but a `priority` still ranks first
AUTO_DEPTH_MIN_SEQS = 4  # below this many sequences overlap cannot pay: depth 1 (as the paper found)
AUTO_PLANNER_DEPTHS = (1, 2, 3, 4)  # what a clock planner may choose among under "auto"
DepthSetting = int | Literal["auto"]  # `microbatch_depth`: a fixed number of microbatches, or "auto"


@dataclass(frozen=True)
class WorkItem(Generic[K]):
    """One sequence as the former sees it; `key` is the caller's handle (its state object, an id)."""

    key: K
    remaining_tokens: int  # tokens not yet fed (1 for a decode step)
    arrival_s: float = 0.0  # on the clock of `now_s`: only the rule's aging reads it
    is_waiting: bool = False  # not admitted yet: must pass `max_num_seqs` and `can_admit`
    is_decode: bool = False  # a decode step (one token after the prompt), not prefill work
    context_tokens: int = 0  # tokens already in its KV (what a decode step attends to)
    priority: int = 0  # vLLM's: lower first (`prefill_order`)


@dataclass(frozen=True)
class PrefillQuery:
    """What the former knows when it asks a prefill cap, once the decode steps are in: the cap (the
    scheduler's `PrefillCap`, `shared.policy.prefill_cap`) prices prompt tokens beside those steps and
    against the queue's TTFT, so these are the figures it reads, by name."""

    queued_tokens: int  # the prompt tokens left in the queue
    n_decode: int = 0  # decode steps already in the iteration
    decode_ctx_tokens: float = 0.0  # their context tokens, together
    head_tokens: int | None = None  # the first request's prompt tokens left, in serving order (None: no bound)
    oldest_wait_s: float = 0.0  # how long the longest-queued prompt has waited


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
                   now_s: float = 0.0, prefill_cap: Callable[[PrefillQuery], int] | None = None,
                   seq_cap: int | None = None,
                   can_admit: Callable[[K], bool] | None = None) -> IterationForm[K]:
    """The sequences of one iteration and the tokens each feeds (module docstring for the rule).

    `running_count` sequences already hold a place toward `max_num_seqs` (None: no limit); `rule`
    (None: queue order) orders the queue at `now_s`, a lower `priority` value first either way;
    `prefill_cap` bounds the queue's tokens once the decode steps are in (asked a `PrefillQuery`: every
    decode step and its context, the queue in serving order, the oldest prompt's wait at `now_s`);
    `seq_cap` bounds one queue item's tokens (a chunked-prefill chunk).
    Items with nothing to feed are skipped. The simulator forms its prefill chunk from its queue,
    already in serving order, with no decodes and nothing waiting (every item is fed, none admitted)::

        items = [WorkItem(rid, rem) for rid, rem in pool.queue]
        form = form_iteration((), items, token_budget=take, seq_cap=seq_chunk_cap(rule, take))
        chunk = [(f.key, f.n_tokens) for f in form.feeds]  # q = min(rem, left, cap), in queue order
    """
    if seq_cap is not None and seq_cap < 1:
        raise ValueError(f"seq_cap must be at least 1 token, got {seq_cap}")
    steps, items = list(decodes), list(queue)  # the cap's query reads them whole
    feeds: list[Feed[K]] = []
    budget = token_budget
    for item in steps:
        if budget <= 0:
            break
        if item.remaining_tokens > 0:
            feeds.append(Feed(item, min(item.remaining_tokens, budget)))
            budget -= feeds[-1].n_tokens
    work = [i for i in items if i.remaining_tokens > 0]
    if len(work) > 1 and (rule is not None or any(i.priority != work[0].priority for i in work)):
        order = prefill_order(rule or FCFS, now_s, [i.arrival_s for i in work],
                              [float(i.remaining_tokens) for i in work], [i.priority for i in work])
        work = [work[k] for k in order]
    if prefill_cap is not None and work:
        query = PrefillQuery(queued_tokens=sum(i.remaining_tokens for i in work), n_decode=len(steps),
                             decode_ctx_tokens=float(sum(i.context_tokens for i in steps)),
                             head_tokens=work[0].remaining_tokens,
                             oldest_wait_s=now_s - min((i.arrival_s for i in items), default=now_s))
        budget = min(budget, max(0, prefill_cap(query)))
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


def parse_depth(setting: str | int) -> DepthSetting:
    """The `microbatch_depth` setting, parsed once where it enters: "auto" or a whole number >= 1."""
    if setting == "auto":
        return "auto"
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
        return setting
    if isinstance(setting, str) and setting.isdecimal() and int(setting) >= 1:
        return int(setting)
    raise ValueError(f"microbatch depth must be 'auto' or a whole number of at least 1, got {setting!r}")


def planner_depths(setting: DepthSetting) -> tuple[int, ...]:
    """The depths a clock planner may choose among: all of them under "auto", else the fixed one."""
    return AUTO_PLANNER_DEPTHS if setting == "auto" else (setting,)


def microbatch_depth(setting: DepthSetting, n_seqs: int, planned: int | None = None, overlaps: bool = True) -> int:
    """How many microbatches an iteration of `n_seqs` sequences is cut into: the one place "auto" is decided.

    A fixed setting is kept; "auto" takes the clock plan's depth for the phase where there is one
    (`planned`), else 1 below AUTO_DEPTH_MIN_SEQS sequences and 2 from there; and 1 where microbatches
    cannot overlap (`overlaps` false: a worker running both halves itself, whose second microbatch only
    streams every weight again: on 2 CPU cores 8-row microbatches in pairs took what 16 rows take twice).
    Never more than n_seqs (a microbatch needs a sequence), never less than 1."""
    if setting == "auto" and not overlaps:
        depth = 1
    elif setting == "auto":
        depth = planned if planned is not None else 1 if n_seqs < AUTO_DEPTH_MIN_SEQS else 2
    else:
        depth = setting
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


@dataclass(frozen=True)
class KvRoom(Generic[K]):
    """What an attention worker's KV cache can still take, as the scheduler estimates it: a waiting item
    is admitted while its first chunk fits in the free blocks (its own reservation given back). With
    nothing running it is always admitted: validation guaranteed a lone sequence fits, and the worker
    refuses it (`failed_seq_ids`) if the estimate was wrong."""

    free_blocks: int
    block_size: int
    reserved_blocks: Mapping[K, int] = field(default_factory=dict)
    holds_running: bool = True

    def admits(self, key: K, first_chunk_tokens: int) -> bool:
        if not self.holds_running:
            return True
        need = -(-first_chunk_tokens // self.block_size) if self.block_size > 0 else 0
        return self.free_blocks + self.reserved_blocks.get(key, 0) >= need


@dataclass(frozen=True)
class IterationPolicy:
    """How one worker's iteration is formed and cut: the batching settings and what the clock policy
    planned (`planned_depth`: the depth its operating point chose per clock phase, used with "auto")."""

    token_budget: int
    max_num_seqs: int | None = None
    rule: BatchingRule | None = None  # None: first-come first-served, running sequences in their order
    now_s: float = 0.0  # on the clock of the items' `arrival_s`
    prefill_cap: Callable[[PrefillQuery], int] | None = None  # most prompt tokens (None: the token budget only)
    depth: DepthSetting = 1  # `microbatch_depth`'s setting, parsed (`parse_depth`)
    planned_depth: Mapping[ClockPhase, int] = field(default_factory=dict)
    overlaps: bool = True  # its microbatches can overlap (its FFN is elsewhere); false: a colocated worker


@dataclass(frozen=True)
class IterationPlan(Generic[K]):
    groups: tuple[tuple[Feed[K], ...], ...]  # the microbatches, in order; empty: nothing to run
    phase: Phase
    admitted: tuple[K, ...]  # the waiting items it admits, in order


def phase_of(feeds: Sequence[Feed[K]]) -> Phase:
    """"decode" when every feed is one decode step, "prefill" when none is, else "mixed"."""
    decodes = sum(f.item.is_decode and f.n_tokens == 1 for f in feeds)
    if decodes == len(feeds):
        return "decode"
    return "prefill" if decodes == 0 else "mixed"


def plan_iteration(running: Sequence[WorkItem[K]], waiting: Iterable[WorkItem[K]], policy: IterationPolicy,
                   kv: KvRoom[K] | None = None, running_count: int | None = None) -> IterationPlan[K]:
    """One iteration of one worker: which sequences, how many tokens each, cut into microbatches.

    `running` are the admitted sequences that can be fed now (in their order), `waiting` the queue;
    `running_count` (default len(running)) is every admitted sequence, in flight or not, toward
    `max_num_seqs`. With a rule or a prefill cap, decode steps go first and the prefill work follows
    in the rule's order; without, the walk is the engine's (running order, then the queue). Depth:
    the clock plan's for this phase under "auto" when it planned one, else `microbatch_depth`.
    """
    ordered = policy.rule is not None or policy.prefill_cap is not None
    decodes = [i for i in running if ordered and i.is_decode]
    queue = [i for i in running if not (ordered and i.is_decode)] + [replace(i, is_waiting=True) for i in waiting]
    sizes = {id(i.key): i.remaining_tokens for i in queue}

    def can_admit(key: K) -> bool:  # the first chunk in the KV room left
        assert kv is not None
        return kv.admits(key, min(sizes[id(key)], policy.token_budget))

    form = form_iteration(decodes, queue, token_budget=policy.token_budget, max_num_seqs=policy.max_num_seqs,
                          running_count=len(running) if running_count is None else running_count,
                          rule=policy.rule, now_s=policy.now_s, prefill_cap=policy.prefill_cap,
                          can_admit=can_admit if kv is not None else None)
    if not form.feeds:
        return IterationPlan((), "decode", form.admitted)
    phase = phase_of(form.feeds)
    depth = microbatch_depth(policy.depth, len(form.feeds), policy.planned_depth.get(clock_phase(phase)),
                             policy.overlaps)
    groups = tuple(form.feeds[r.start:r.stop] for r in split_microbatches([f.n_tokens for f in form.feeds], depth))
    return IterationPlan(groups, phase, form.admitted)

"""Forming one iteration of one attention worker, and cutting it into microbatches. Pure: no I/O.

The default rule is the in-process engine's (`shared.model.engine.Engine._schedule`): running
sequences first (a decode step feeds the last sampled token; an unfinished prefill feeds its next
chunk), then waiting ones are admitted first-come first-served while the token budget and
`max_num_seqs` allow, their prompts chunked to what is left of the budget.

With a `BatchingRule` (the `aflex` policy): decode steps first, then the prefill work (unfinished
prefills of running sequences and waiting requests) in the rule's order (`shared.policy.prefill_order`
at `now`, each request's arrival being its `received_mono`: shortest remaining prompt first, with
aging), within the token budget and, if `prefill_cap` is given, at most that many prefill tokens.
Admission of waiting requests still stops at the first refusal, so a request that has aged to the
front is not overtaken while it waits for room. Nothing here mutates the request states: the service
applies the plan, so the plan can be unit-tested.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.scheduler.state import RequestState
from shared.messages import Phase, SeqWork
from shared.policy import BatchingRule, prefill_order

# (prefill tokens queued, decode sequences, their context tokens, the first prompt's tokens) -> prefill tokens
PrefillCap = Callable[[int, int, float, int], int]

AUTO_DEPTH_MIN_SEQS = 4  # below this many sequences overlap cannot pay: depth 1 (as the paper found)


@dataclass(frozen=True)
class Pass:
    """`n_new` tokens of `state` fed in this iteration, from position `start` (fixed when planned:
    the state moves on when the results are applied, the pass does not)."""

    state: RequestState
    n_new: int
    start: int
    samples: bool  # the pass reaches the last known token: the worker samples the next one

    @classmethod
    def of(cls, state: RequestState, n_new: int) -> Pass:
        start = state.num_computed
        return cls(state, n_new, start, start + n_new == state.num_tokens)

    @property
    def is_decode(self) -> bool:
        return self.n_new == 1 and self.start >= len(self.state.prompt_ids)

    def seq_work(self) -> SeqWork:
        s = self.state
        first = not s.first_pass_sent
        return SeqWork(seq_id=s.request_id, token_ids=s.all_ids[self.start:self.start + self.n_new],
                       start_pos=self.start, sample=self.samples, sampling=s.sampling if first else None,
                       generated_ids=list(s.output_ids) if first else [])


def plan_iteration(running: Iterable[RequestState], waiting: Iterable[RequestState], *, max_batch_tokens: int,
                   max_num_seqs: int, can_admit: Callable[[RequestState], bool] | None = None,
                   rule: BatchingRule | None = None, now: float = 0.0, prefill_cap: PrefillCap | None = None,
                   ) -> tuple[list[Pass], list[RequestState]]:
    """Passes for this iteration, and the waiting requests they admit (in order).

    Running sequences already in flight or with nothing to feed are skipped. `can_admit` lets the
    caller refuse a waiting request (e.g. not enough free KV); admission stops at the first refusal
    so no later request overtakes it. `rule` (with `now`, on the clock of `received_mono`) and
    `prefill_cap` select the policy's ordering and prefill cap (module docstring).
    """
    running = list(running)
    if rule is None and prefill_cap is None:
        return _plan_fcfs(running, waiting, max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs,
                          can_admit=can_admit)
    live = [s for s in running if not (s.in_flight or s.finished) and s.pending_tokens > 0]
    decodes = [s for s in live if s.num_computed >= len(s.prompt_ids)]
    prefills = [s for s in live if s.num_computed < len(s.prompt_ids)]
    queue: list[tuple[RequestState, bool]] = [(s, False) for s in prefills] + [(s, True) for s in waiting]
    if rule is not None and len(queue) > 1:
        order = prefill_order(rule, now, [s.received_mono for s, _ in queue],
                              [float(s.pending_tokens) for s, _ in queue])
        queue = [queue[k] for k in order]
    passes: list[Pass] = []
    budget = max_batch_tokens
    for state in decodes:
        if budget <= 0:
            break
        n_new = min(state.pending_tokens, budget)
        passes.append(Pass.of(state, n_new))
        budget -= n_new
    if prefill_cap is not None and queue:
        queued = sum(s.pending_tokens for s, _ in queue)
        ctx = float(sum(s.num_computed for s in decodes))
        budget = min(budget, max(0, prefill_cap(queued, len(decodes), ctx, queue[0][0].pending_tokens)))
    admitted: list[RequestState] = []
    admitting = True
    for state, is_waiting in queue:
        if budget <= 0:
            break
        if is_waiting:
            if not admitting:
                continue
            if len(running) + len(admitted) >= max_num_seqs or (can_admit is not None and not can_admit(state)):
                admitting = False  # no later waiting request overtakes it; running prefills go on
                continue
            admitted.append(state)
        n_new = min(state.pending_tokens, budget)
        passes.append(Pass.of(state, n_new))
        budget -= n_new
    return passes, admitted


def _plan_fcfs(running: list[RequestState], waiting: Iterable[RequestState], *, max_batch_tokens: int,
               max_num_seqs: int, can_admit: Callable[[RequestState], bool] | None,
               ) -> tuple[list[Pass], list[RequestState]]:
    """The engine's rule: running sequences in their order, then waiting ones first-come first-served."""
    passes: list[Pass] = []
    budget = max_batch_tokens
    for state in running:
        if budget <= 0:
            break
        if state.in_flight or state.finished:
            continue
        n_new = min(state.pending_tokens, budget)
        if n_new > 0:
            passes.append(Pass.of(state, n_new))
            budget -= n_new
    admitted: list[RequestState] = []
    for state in waiting:
        if budget <= 0 or len(running) + len(admitted) >= max_num_seqs:
            break
        if can_admit is not None and not can_admit(state):
            break
        n_new = min(state.pending_tokens, budget)
        passes.append(Pass.of(state, n_new))
        admitted.append(state)
        budget -= n_new
    return passes, admitted


def microbatch_depth(setting: str, n_seqs: int) -> int:
    """`"1"`..`"4"` fixed; `"auto"`: 1 below AUTO_DEPTH_MIN_SEQS sequences, else 2. Never more than n_seqs."""
    depth = (1 if n_seqs < AUTO_DEPTH_MIN_SEQS else 2) if setting == "auto" else int(setting)
    return max(1, min(depth, n_seqs))


def split_microbatches(passes: list[Pass], depth: int) -> list[list[Pass]]:
    """Cut passes into at most `depth` contiguous, non-empty groups of about equal tokens.

    Contiguous by token count like `engine.split_microbatches`, but every group gets at least one
    sequence when there are enough, so depth 2 of a long prefill plus a decode still pipelines.
    """
    if not passes:
        return []
    depth = max(1, min(depth, len(passes)))
    total = sum(p.n_new for p in passes)
    groups: list[list[Pass]] = []
    current: list[Pass] = []
    done = 0
    for index, p in enumerate(passes):
        left = len(passes) - index  # passes still to place, p included
        later = depth - len(groups) - 1  # groups that come after the current one
        if current and later > 0 and (done * depth >= (len(groups) + 1) * total or left <= later):
            groups.append(current)
            current = []
        current.append(p)
        done += p.n_new
    groups.append(current)
    return groups


def phase_of(passes: list[Pass]) -> Phase:
    decodes = sum(p.is_decode for p in passes)
    if decodes == len(passes):
        return "decode"
    return "prefill" if decodes == 0 else "mixed"

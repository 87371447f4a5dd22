"""Forming one iteration of one attention worker, and cutting it into microbatches. Pure: no I/O.

The rule is the in-process engine's (`shared.model.engine.Engine._schedule`): running sequences
first (a decode step feeds the last sampled token; an unfinished prefill feeds its next chunk),
then waiting ones are admitted while the token budget and `max_num_seqs` allow, their prompts
chunked to what is left of the budget. Nothing here mutates the request states: the service
applies the plan, so the plan can be unit-tested and reused by the simulator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.scheduler.state import RequestState
from shared.messages import Phase, SeqWork

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
                   ) -> tuple[list[Pass], list[RequestState]]:
    """Passes for this iteration, and the waiting requests they admit (in order).

    Running sequences already in flight or with nothing to feed are skipped. `can_admit` lets the
    caller refuse a waiting request (e.g. not enough free KV); admission stops at the first refusal
    so the queue stays first-come first-served.
    """
    running = list(running)
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

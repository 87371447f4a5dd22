"""Forming one iteration of one attention worker, and cutting it into microbatches. Pure: no I/O.

The rules are `shared.policy.iteration`'s (`form_iteration`, `split_microbatches`), which the
simulator and the in-process engine use too; this module adapts them to the scheduler's request
states and passes.

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
from shared.policy import BatchingRule, WorkItem, form_iteration, microbatch_depth
from shared.policy import split_microbatches as split_by_tokens
from shared.policy.iteration import PrefillCap as FormCap

__all__ = ["Pass", "PrefillCap", "microbatch_depth", "phase_of", "plan_iteration", "split_microbatches"]

# (prefill tokens queued, decode sequences, their context tokens, the first prompt's tokens) -> prefill tokens
PrefillCap = Callable[[int, int, float, int], int]


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
    policy = rule is not None or prefill_cap is not None
    decodes: list[RequestState] = []
    queue: list[WorkItem[RequestState]] = []
    for s in running:
        if s.in_flight or s.finished or s.pending_tokens <= 0:
            continue
        if policy and s.num_computed >= len(s.prompt_ids):  # decode steps first (the engine: running order)
            decodes.append(s)
        else:
            queue.append(_item(s, False))
    queue += [_item(s, True) for s in waiting]
    form = form_iteration([_item(s, False) for s in decodes], queue, token_budget=max_batch_tokens,
                          max_num_seqs=max_num_seqs, running_count=len(running), rule=rule, now_s=now,
                          prefill_cap=_form_cap(prefill_cap, decodes), can_admit=can_admit)
    return [Pass.of(f.key, f.n_tokens) for f in form.feeds], list(form.admitted)


def _form_cap(prefill_cap: PrefillCap | None, decodes: list[RequestState]) -> FormCap | None:
    """`prefill_cap` told what only the scheduler knows: the decode steps beside the prefill."""
    if prefill_cap is None:
        return None
    n_decode, ctx = len(decodes), float(sum(s.num_computed for s in decodes))
    return lambda queued, head: prefill_cap(queued, n_decode, ctx, head)


def _item(state: RequestState, waiting: bool) -> WorkItem[RequestState]:
    return WorkItem(state, state.pending_tokens, state.received_mono, waiting)


def split_microbatches(passes: list[Pass], depth: int) -> list[list[Pass]]:
    """`passes` cut into microbatches by `shared.policy.split_microbatches`."""
    return [passes[r.start:r.stop] for r in split_by_tokens([p.n_new for p in passes], depth)]


def phase_of(passes: list[Pass]) -> Phase:
    decodes = sum(p.is_decode for p in passes)
    if decodes == len(passes):
        return "decode"
    return "prefill" if decodes == 0 else "mixed"

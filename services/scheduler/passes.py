"""One attention worker's iteration as passes over its request states. Pure: no I/O.

The decision is `shared.policy.plan_iteration`'s (the simulator's and the engine's iteration former,
the microbatch cut and the depth); this module only translates: request states to `WorkItem`s (and
the worker's KV estimate to a `KvRoom`), the plan's feeds back to `Pass`es. Nothing here mutates the
request states: the service applies the plan, so the plan can be unit-tested.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.scheduler.registry import Worker
from services.scheduler.state import RequestState
from shared.kinds import Phase
from shared.messages import MicrobatchDescriptor, SeqWork
from shared.policy.iteration import IterationPolicy, KvRoom, WorkItem, phase_of, plan_iteration

__all__ = ["Pass", "PassPlan", "plan_passes", "share_energy"]


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
                       generated_ids=list(s.output_ids) if first else [], fork_of=s.fork_from if first else None,
                       kv_from=s.kv_from if first else None, prefix=s.prefix_names if first else None)


@dataclass(frozen=True)
class PassPlan:
    groups: list[list[Pass]]  # the microbatches, in order; empty: nothing to run
    phase: Phase  # of the whole iteration
    phases: list[Phase]  # of each microbatch
    admitted: list[RequestState]  # waiting requests it admits, in order

    @property
    def passes(self) -> list[Pass]:
        return [p for g in self.groups for p in g]


def plan_passes(running: Sequence[RequestState], waiting: Iterable[RequestState], policy: IterationPolicy,
                kv: KvRoom[RequestState] | None = None) -> PassPlan:
    """The iteration `shared.policy.plan_iteration` forms from these states. Running sequences already in
    flight or with nothing to feed are left out (they still count toward `max_num_seqs`)."""
    feedable = [_item(s) for s in running if not s.in_flight and not s.finished and s.pending_tokens > 0]
    plan = plan_iteration(feedable, [_item(s) for s in waiting], policy, kv, running_count=len(running))
    return PassPlan([[Pass.of(f.key, f.n_tokens) for f in g] for g in plan.groups], plan.phase,
                    [phase_of(g) for g in plan.groups], list(plan.admitted))


def _item(state: RequestState) -> WorkItem[RequestState]:
    decode = state.num_computed >= len(state.prompt_ids)
    return WorkItem(state, state.pending_tokens, state.received_mono, is_decode=decode,
                    context_tokens=state.num_computed, priority=state.priority)


def share_energy(group: list[Pass], energy_j: float, refused: set[str]) -> None:
    """Add each pass's share of a microbatch's energy to its request, in proportion to the tokens it fed.

    Sequences the worker refused fed nothing and get nothing (unless all were refused). The last
    share is the remainder, so the shares add up to `energy_j` exactly as floats allow.
    """
    takers = [p for p in group if p.state.request_id not in refused] or group
    if not takers:
        return
    total = sum(p.n_new for p in takers)
    left = energy_j
    for i, p in enumerate(takers):
        share = left if i == len(takers) - 1 else (
            energy_j * p.n_new / total if total > 0 else energy_j / len(takers))
        left -= share
        p.state.energy_j = (p.state.energy_j or 0.0) + share


def release_only(worker: Worker, ffn_worker_id: str, run_token: str) -> MicrobatchDescriptor:
    """A descriptor that runs nothing and frees the KV of the lane's finished sequences now."""
    lane = worker.lane
    iteration = lane.next_iteration()
    return MicrobatchDescriptor(mb_id=f"{run_token}-{worker.worker_id}-{iteration}-r", iteration=iteration,
                                phase="decode", ffn_worker=ffn_worker_id, seqs=[], release=lane.take_releases())

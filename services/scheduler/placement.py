"""Where a request waits: on the attention worker with the most free KV, beside the choice it forks, or unplaced.

The n choices of one request share their prompt's KV: the first prefills it, the others fork it.
The gateway submits choice 0, then the others with `fork_of` naming it. A later choice waits until
choice 0 has computed all of the prompt but its last token, then starts on the same attention worker
with its KV table forked from choice 0's (`SeqWork.fork_of`: the blocks are shared, and copied when
either sequence writes into a shared one) and feeds only the prompt's last token, whose logits it
samples from with its own seed. So the prompt is prefilled once for n choices, and each choice's
tokens are exactly those of a request of its own.

Not shared (the choice prefills the prompt itself): when it asks for the prompt's logprobs (they come
from the prefill's rows) or for a repetition penalty (its sampler must see the whole prompt), when it
is a continuation, and when choice 0 is gone or was recomputed elsewhere before the fork was sent.
"""

from __future__ import annotations

import logging

from services.scheduler.registry import AttentionLane, Registry
from services.scheduler.state import RequestState, Status

log = logging.getLogger("aflex.scheduler")


def shares_prompt(parent: RequestState | None, child: RequestState) -> bool:
    """Whether `child` may fork `parent`'s prompt KV (now or once `parent` has prefilled it)."""
    return (parent is not None and not parent.finished and parent.prompt_ids == child.prompt_ids
            and len(child.prompt_ids) >= 2 and child.base_tokens == 0 and child.sampling.prompt_logprobs is None
            and not child.sampling.has_repetition_penalty)


def prefilled(parent: RequestState) -> bool:
    """`parent`'s worker holds its prompt but the last token: a fork can start now."""
    return (parent.status is Status.RUNNING and parent.worker_id is not None
            and parent.num_computed >= len(parent.prompt_ids) - 1)


def _place(child: RequestState, parent: RequestState, lane: AttentionLane) -> None:
    """Queue `child` at the front of `parent`'s lane, its first pass feeding only the prompt's last token."""
    child.worker_id = parent.worker_id
    child.num_computed = len(child.prompt_ids) - 1
    child.fork_from = parent.request_id
    child.status = Status.WAITING
    lane.reserved_blocks[child.request_id] = lane.blocks_for(1 + child.sampling.max_tokens)
    lane.waiting.appendleft(child)
    lane.wake.set()


class Placement:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.unplaced: list[RequestState] = []  # waiting while no attention worker can take them

    def route(self, state: RequestState, *, front: bool = False) -> None:
        """Queue `state` on the attention worker with the most free KV (estimated), or leave it unplaced."""
        need = len(state.prompt_ids) + state.sampling.max_tokens
        worker = self.registry.best_attention(need)
        state.status = Status.WAITING
        if worker is None:
            state.worker_id = None
            self.unplaced.append(state)
            return
        state.worker_id = worker.worker_id
        lane = worker.lane
        lane.reserved_blocks[state.request_id] = lane.blocks_for(need)
        if front:
            lane.waiting.appendleft(state)
        else:
            lane.waiting.append(state)
        lane.wake.set()

    def admit(self, state: RequestState, parent: RequestState | None) -> None:
        """A new request: beside `parent` (the choice it may fork) when it shares its prompt, else routed."""
        if parent is None or not shares_prompt(parent, state):
            self.route(state)
        elif prefilled(parent):
            self.fork(state, parent)
        else:
            parent.forks.append(state)  # placed once its prompt is in (`prompt_in`)
            state.held_by = parent

    def prompt_in(self, parent: RequestState) -> None:
        """`parent` has computed another pass: the choices waiting on its prompt start when it is in."""
        if parent.forks and prefilled(parent):
            for child in parent.forks:
                self.fork(child, parent)
            parent.forks.clear()

    def fork(self, child: RequestState, parent: RequestState) -> None:
        """Start `child` on `parent`'s worker, sharing its prompt KV; routed as any request where it cannot."""
        child.held_by = None
        worker = self.registry.workers.get(parent.worker_id or "")
        if worker is None or not worker.healthy or worker.attention_lane is None or not prefilled(parent):
            self.route(child)
            return
        _place(child, parent, worker.attention_lane)
        log.info("request %s shares the prompt KV of %s on %s", child.request_id, parent.request_id,
                 worker.worker_id)

    def finished(self, state: RequestState) -> None:
        """`state` is done: out of the unplaced list; choices waiting on it prefill the prompt themselves."""
        if state in self.unplaced:
            self.unplaced.remove(state)
        for child in state.forks:
            child.held_by = None
            self.route(child)
        state.forks.clear()
        if state.held_by is not None:
            state.held_by.forks.remove(state)
            state.held_by = None

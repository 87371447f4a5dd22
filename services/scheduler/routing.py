"""Where a request waits: on the attention worker with the most free KV, beside the choice it forks, or unplaced.

The fork rules (which choice shares whose prompt KV, and when) are forks.py's; this module routes.
"""

from __future__ import annotations

import logging

from services.scheduler import forks
from services.scheduler.registry import AttentionLane, Registry
from services.scheduler.state import RequestState, Status

log = logging.getLogger("aflex.scheduler")


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

    def reroute_unstarted(self, lane: AttentionLane) -> None:
        """The lane's worker takes no new work (parked): its queued requests with nothing computed and no
        prompt KV to share go elsewhere; what holds KV there finishes there."""
        for state in [s for s in lane.waiting if not (s.first_pass_sent or s.num_computed or s.fork_from)]:
            lane.detach(state)
            self.route(state)

    def admit(self, state: RequestState, parent: RequestState | None) -> None:
        """A new request: beside `parent` (the choice it may fork) when it shares its prompt, else routed."""
        if parent is None or not forks.shares_prompt(parent, state):
            self.route(state)
        elif forks.prefilled(parent):
            self.fork(state, parent)
        else:
            forks.hold(state, parent)  # placed once its prompt is in (`prompt_in`)

    def prompt_in(self, parent: RequestState) -> None:
        """`parent` has computed another pass: the choices waiting on its prompt start when it is in."""
        for child in forks.take_ready(parent):
            self.fork(child, parent)

    def fork(self, child: RequestState, parent: RequestState) -> None:
        """Start `child` on `parent`'s worker, sharing its prompt KV; routed as any request where it cannot."""
        child.held_by = None
        worker = self.registry.workers.get(parent.worker_id or "")
        if worker is None or not worker.healthy or worker.attention_lane is None or not forks.prefilled(parent):
            self.route(child)
            return
        forks.place(child, parent, worker.attention_lane)
        log.info("request %s shares the prompt KV of %s on %s", child.request_id, parent.request_id,
                 worker.worker_id)

    def finished(self, state: RequestState) -> None:
        """`state` is done: out of the unplaced list; choices waiting on it prefill the prompt themselves."""
        if state in self.unplaced:
            self.unplaced.remove(state)
        for child in forks.let_go(state):
            self.route(child)

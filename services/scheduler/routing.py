"""Where a request waits: on the attention worker holding the longest cached prefix of its prompt (unless
that worker is much busier), else the one with the most free KV; beside the choice it forks; or unplaced.

The fork rules (which choice shares whose prompt KV, and when) are forks.py's, the prefix cache's
prefix_index.py's; this module routes.
"""

from __future__ import annotations

import logging

from services.scheduler import forks
from services.scheduler.prefix_index import PrefixIndex
from services.scheduler.registry import AttentionLane, Registry, Worker
from services.scheduler.state import RequestState, Status

log = logging.getLogger("aflex.scheduler")

PREFIX_QUEUE_SLACK = 4  # a cached prefix wins a worker this many more queued/running requests than the least busy


class Placement:
    def __init__(self, registry: Registry, prefixes: PrefixIndex | None = None) -> None:
        self.registry = registry
        self.prefixes = prefixes  # None: prefix caching off
        self.unplaced: list[RequestState] = []  # waiting while no attention worker can take them

    def route(self, state: RequestState, *, front: bool = False) -> None:
        """Queue `state` on the attention worker with its longest cached prefix, or the most free KV
        (estimated), or leave it unplaced."""
        need = len(state.prompt_ids) + state.sampling.max_tokens
        if state.prefix_names and not state.first_pass_sent:  # a cached start chosen elsewhere is chosen again
            state.prefix_names, state.num_computed, state.cached_tokens = None, 0, 0
        fits = self.registry.attention_fits(need)
        state.status = Status.WAITING
        if not fits:
            state.worker_id = None
            self.unplaced.append(state)
            return
        worker = self._with_prefix(state, fits) or fits[0]
        state.worker_id = worker.worker_id
        worker.lane.queue(state, need, front=front)

    def _with_prefix(self, state: RequestState, fits: list[Worker]) -> Worker | None:
        """The worker holding the longest cached prefix of `state`'s prompt, if it is not much busier than the
        least busy one; `state` then starts with those blocks. None: no worker holds any."""
        if self.prefixes is None or state.num_computed or state.fork_from or state.kv_from:
            return None
        busy = {w.worker_id: len(w.lane.running) + len(w.lane.waiting) for w in fits}
        least = min(busy.values())
        best: Worker | None = None
        best_names: list[int] = []
        names_by_size: dict[int, list[int]] = {}  # the prompt's names, hashed once per block size
        for w in fits:
            if w.block_size not in names_by_size:
                names_by_size[w.block_size] = self.prefixes.prompt_names(state, w.block_size)
            names = names_by_size[w.block_size]
            held = self.prefixes.match(w.worker_id, names)
            if held > len(best_names) and busy[w.worker_id] <= least + PREFIX_QUEUE_SLACK:
                best, best_names = w, names[:held]
        if best is not None:
            self.prefixes.start(best.worker_id, state, best_names, best.block_size)
        return best

    def reroute_unstarted(self, lane: AttentionLane) -> None:
        """The lane's worker takes no new work (parked): its queued requests with nothing computed and no
        prompt KV to share go elsewhere; what holds KV there finishes there (a cached start is chosen again)."""
        for state in [s for s in lane.waiting
                      if not (s.first_pass_sent or (s.num_computed and not s.prefix_names) or s.fork_from)]:
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

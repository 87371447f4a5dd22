"""P/D pools, live: once a prefill attention worker has sampled a sequence's token, its KV moves to a decode one.

The global scheduler's "pd" plan names prefill and decode attention workers (fleet_plan.py). New
requests go to the prefill ones (`Placement.route` over `Registry.attention_fits`, which leaves a decode
worker out while another fits); each time a pass on a prefill worker samples a token of a sequence that
is not finished, dispatch asks `Handoffs.wanted`, and the move runs as a task of its own: a `KVHandoff`
request to the prefill worker on NATS, which sends the KV to the decode worker's KV seam over
torch.distributed and answers once it arrived (services/attention_worker/kv_handoff.py). Meanwhile the
sequence is `in_flight`, so no pass feeds it. Then it moves from the prefill worker's lane (its KV there
is released) to the decode worker's (`AttentionLane.move`), whose first pass names the arrived KV
(`SeqWork.kv_from`).

What stays where it is, decoded by the prefill worker as in a mixed pool: a sequence with no decode
worker to go to (none healthy with room) or whose move failed; one with a repetition penalty (its
sampler must see the prompt, which a moved sequence's does not get); one whose prompt KV a choice
still waits to fork (forks.py). Nothing is lost when either worker dies mid-move: a lost prefill
worker's sequences are recomputed as ever (recovery.py), a lost decode worker fails the move (the
sequence stays), and a KV that arrived for a sequence sent elsewhere expires on its worker.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from nats.aio.client import Client

from services.scheduler.recovery import SeamAvoidance
from services.scheduler.registry import Registry, Worker
from services.scheduler.state import RequestState
from shared import subjects
from shared.kinds import decodes_only, prefills_only
from shared.messages import KVHandoff, KVHandoffReply, decode, encode

log = logging.getLogger("aflex.scheduler")


class Handoffs:
    def __init__(self, nc: Client, registry: Registry, run_token: str, timeout_s: float,
                 spawn: Callable[[Coroutine[Any, Any, None]], object]) -> None:
        self.nc, self.registry, self.run_token, self.timeout_s, self.spawn = nc, registry, run_token, timeout_s, spawn
        self.avoidance = SeamAvoidance()  # recovery.py's rule: which decode workers a move skips for now
        self._ids = itertools.count(1)
        self.moved = self.failed = 0
        self.moved_bytes = 0
        self.moved_s = 0.0  # the prefill workers' seconds from the request to the decode worker's acknowledgement

    def figures(self) -> dict[str, int | float]:
        """The moves so far, as `SchedulerTelemetry` carries them."""
        return {"kv_handoffs": self.moved, "kv_handoff_failures": self.failed, "kv_handoff_bytes": self.moved_bytes,
                "kv_handoff_s": self.moved_s}

    def wanted(self, worker: Worker, state: RequestState) -> bool:
        """Whether `state`, whose pass on `worker` just sampled a token, moves to a decode worker now."""
        lane = worker.attention_lane
        return (prefills_only(worker.assignment) and lane is not None and state in lane.running
                and not state.finished and not state.in_flight and state.worker_id == worker.worker_id
                and state.num_computed >= len(state.prompt_ids) and not state.sampling.has_repetition_penalty
                and not state.forks and not any(s.fork_from == state.request_id for s in lane.waiting))

    def target(self, state: RequestState) -> Worker | None:
        """The decode worker with a KV seam, able to hold the whole sequence, with the most free KV (estimated)."""
        need = len(state.prompt_ids) + state.sampling.max_tokens
        now = time.monotonic()
        fits = [w for w in self.registry.usable_attention()
                if decodes_only(w.assignment) and w.kv_address and w.capacity_tokens >= need
                and not self.avoidance.avoided(w.worker_id, now)
                and w.lane.est_free_blocks >= w.lane.blocks_for(need)]
        return max(fits, key=lambda w: (w.lane.est_free_blocks, -len(w.lane.running)), default=None)

    def start(self, worker: Worker, state: RequestState) -> bool:
        """Move `state` off `worker` if a decode worker can take it; False: it stays (and decodes there)."""
        target = self.target(state)
        if target is None:
            return False
        state.in_flight = True  # no pass feeds it while its KV moves
        self.spawn(self._move(worker, target, state, worker.lane.epoch))
        return True

    async def _move(self, source: Worker, target: Worker, state: RequestState, epoch: int) -> None:
        handoff_id = f"{self.run_token}-kv{next(self._ids)}"
        req = KVHandoff(handoff_id=handoff_id, seq_id=state.request_id, num_tokens=state.num_computed,
                        to_worker=target.worker_id, to_address=target.kv_address)
        reply: KVHandoffReply | None = None
        why = ""
        try:
            msg = await self.nc.request(subjects.attn_kv(source.worker_id), encode(req), timeout=self.timeout_s)
            reply = decode(KVHandoffReply, msg.data)
            why = reply.error.message if reply.error else ""
        except Exception as exc:  # no responders (the prefill worker is gone), a timeout, a bad reply
            why = f"{type(exc).__name__}: {exc}"
        lane = source.lane
        if state.finished or state.worker_id != source.worker_id or lane.epoch != epoch or state not in lane.running:
            return  # cancelled, or taken back (its worker lost) meanwhile: an arrived KV expires unclaimed
        state.in_flight = False
        if reply is None or not reply.ok or not target.healthy or target.parked:
            self.failed += 1
            self.avoidance.handoff_failed(target.worker_id, reply, time.monotonic())
            log.warning("request %s: KV handoff %s from %s to %s failed, it decodes where it is: %s",
                        state.request_id, handoff_id, source.worker_id, target.worker_id,
                        why or f"{target.worker_id} left decode meanwhile")
            lane.wake.set()
            return
        lane.move(state, target.lane, len(state.prompt_ids) + state.sampling.max_tokens)
        state.worker_id, state.kv_from, state.first_pass_sent = target.worker_id, handoff_id, False
        self.moved += 1
        self.moved_bytes += reply.nbytes
        self.moved_s += reply.seconds
        log.debug("request %s: %d tokens of KV (%d bytes) moved %s -> %s in %.1f ms", state.request_id,
                  req.num_tokens, reply.nbytes, source.worker_id, target.worker_id, reply.seconds * 1e3)

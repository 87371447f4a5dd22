"""The scheduler's control section: workers register, heartbeat and are lost; capacity and plans change.

Dispatch (service.py) owns the request states and the per-worker loops; this module keeps the mesh's
membership in step with them: a worker that registers (again, after a restart) or comes back starts
its loop and takes the unplaced requests; one that goes silent is lost (recovery.py) and, if it
served, the global scheduler plans again at once; a plan that parks a worker, or makes it a decode
worker of P/D pools, sends its unstarted requests elsewhere. It also sheds requests past their queue
deadline and answers status requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from services.scheduler import recovery
from services.scheduler.admission import RETRY_AFTER_S, overdue
from services.scheduler.registry import Worker
from services.scheduler.state import Status
from shared import subjects
from shared.error_types import ErrorType
from shared.messages import (
    ErrorBody,
    Heartbeat,
    ProtocolError,
    Register,
    RegisterReply,
    SchedulerStatus,
    decode,
    encode,
)

if TYPE_CHECKING:
    from services.scheduler.service import Scheduler

log = logging.getLogger("aflex.scheduler")


class Membership:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched

    def _register_reply(self, ok: bool, error: str | None = None) -> bytes:
        body = None if error is None else ErrorBody(type=ErrorType.INVALID_REQUEST, message=error)
        return encode(RegisterReply(ok=ok, scheduler_id=self.sched.settings.scheduler_id, error=body,
                                    scheduler_instance=self.sched.run_token))

    async def on_register(self, msg: Msg) -> None:
        try:
            reg = decode(Register, msg.data)
            subjects.check_token(reg.worker_id)
        except (ProtocolError, ValueError) as exc:
            await msg.respond(self._register_reply(False, str(exc)))
            return
        worker, restarted = self.sched.registry.register(reg, time.monotonic())
        log.info("worker %s (%s) registered%s", reg.worker_id, reg.role, " again: restarted" if restarted else "")
        if worker.role == "attention" and restarted:
            self._lose_attention(worker, restarted=True)  # its KV is empty now: recompute what it held
        await msg.respond(self._register_reply(True))
        self.capacity_changed()
        self.sched.governor.worker_restarted(worker.worker_id)
        if self.sched.settings.freq_window_s > 0:
            await self.sched.freq_window([worker])

    async def on_heartbeat(self, msg: Msg) -> None:
        hb = decode(Heartbeat, msg.data)
        now = time.monotonic()
        worker, revived = self.sched.registry.heartbeat(hb, now)
        if not worker.registered and msg.reply:  # e.g. this scheduler is new: ask it to register again
            await msg.respond(self._register_reply(False))
        if revived:
            log.info("worker %s is healthy again", worker.worker_id)
            self.capacity_changed()
        if hb.active_mb_ids is not None:
            self.sched.in_flight.check_heartbeat(hb.worker_id, set(hb.active_mb_ids), now,
                                           self.sched.settings.microbatch_lost_after_s, hb.newest_mb_id)

    def capacity_changed(self) -> None:
        """A worker joined or came back: place unplaced requests, start loops, wake every loop."""
        for worker in self.sched.registry.usable_attention():
            if worker.lane.task is None or worker.lane.task.done():
                worker.lane.task = self.sched._spawn(self.sched._worker_loop(worker))
        unplaced, self.sched.placement.unplaced = self.sched.placement.unplaced, []
        for state in unplaced:
            self.sched.placement.route(state)
        for worker in self.sched.registry.healthy("attention"):
            worker.lane.wake.set()

    def plan_changed(self, changed: list[Worker]) -> None:
        """The global scheduler moved `changed`: a parked attention worker's requests that have not started
        go elsewhere (what it holds finishes there), woken ones start taking work, and every changed
        worker gets its clocks now rather than at the next frequency window."""
        for worker in changed:  # a decode worker of a P/D plan takes no new requests either
            if (worker.parked or worker.assignment == "decode-attention") and worker.attention_lane is not None:
                self.sched.placement.reroute_unstarted(worker.attention_lane)
        self.capacity_changed()
        if self.sched.settings.freq_window_s > 0:
            self.sched._spawn(self.sched.freq_window(changed))

    def _lose_attention(self, worker: Worker, *, restarted: bool) -> None:
        """An attention worker's KV is gone (it restarted) or out of reach: what it held is recomputed
        elsewhere (`recovery.lose`) and no prefix is looked for there."""
        recovery.lose(worker, self.sched.in_flight, restarted=restarted)
        if self.sched.prefixes is not None:
            self.sched.prefixes.lost(worker.worker_id)

    async def health_loop(self) -> None:
        timeout = self.sched.settings.heartbeat_timeout_s
        while True:
            await asyncio.sleep(min(0.5, timeout / 4))
            for worker in self.sched.registry.expire(time.monotonic(), timeout):
                log.warning("worker %s (%s) missed heartbeats for %.1f s: unhealthy", worker.worker_id,
                            worker.role, timeout)
                if worker.role == "attention":
                    self._lose_attention(worker, restarted=False)
                if self.sched.provisioning is not None:
                    self.sched.provisioning.lost(worker)
            for state in self.sched.gateways.orphans(time.monotonic(), list(self.sched.requests.values())):
                if not state.finished:  # (finished meanwhile, while a delta was published)
                    await self.sched._finish(state, "abort")
            await self._shed_overdue(time.monotonic())

    async def _shed_overdue(self, now: float) -> None:
        """Refuse the requests that waited `queue_deadline_s` without starting, so the served keep their TTFT:
        429 (503 while no workers are ready)."""
        for state in [s for s in self.sched.requests.values() if s.status is Status.WAITING]:
            error = None if state.finished else overdue(state, now, self.sched.settings.queue_deadline_s,
                                                        ready=self.sched.registry.ready)
            if error is None:
                continue
            log.info("request %s shed: %s", state.request_id, error.message)
            try:
                await self.sched._finish(state, "error", error, retry_after_s=RETRY_AFTER_S)
            except Exception as exc:  # a publish into a closed connection: the health loop must go on
                log.warning("request %s: its refusal could not be sent: %s", state.request_id, exc)

    def on_bus_lost(self) -> None:
        """The NATS connection dropped: every in-flight microbatch is a suspect the next heartbeat settles."""
        self.sched.in_flight.bus_lost()

    async def on_status(self, msg: Msg) -> None:
        now = time.monotonic()
        status = SchedulerStatus(ready=self.sched.registry.ready, scheduler_id=self.sched.settings.scheduler_id,
                                 model_id=self.sched.model.model_id,
                                 workers=[w.info(now) for w in self.sched.registry.workers.values()],
                                 queue_depth=self.sched.queue_depth, running=self.sched.running_count)
        await msg.respond(encode(status))

"""The mesh's membership: which workers are in it, and what each change of it asks of dispatch.

Membership answers, the scheduler applies, as recovery.py does with its verdicts: a registration, a
heartbeat, a silence past the timeout or a new plan of the global scheduler updates the registry here
and comes back as a `Change`: the lanes to start, the workers whose unstarted requests go elsewhere,
the workers lost or restarted, the workers whose clocks to send now. service.py acts on it. Nothing
here ends a request, starts a task or publishes, so a new control event is one more method returning
a `Change`, and who may end a request stays one place (dispatch).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from services.scheduler.registry import Registry, Worker
from shared import subjects
from shared.error_types import ErrorType
from shared.kinds import decodes_only
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

log = logging.getLogger("aflex.scheduler")


@dataclass
class Change:
    """What a membership event asks of dispatch, in the order it applies them."""

    lost: list[Worker] = field(default_factory=list)  # went silent: what they held is taken back, plans again
    restarted: list[Worker] = field(default_factory=list)  # registered again: their KV is empty, recompute
    joined: list[Worker] = field(default_factory=list)  # registered (first time or again): start over
    reroute: list[Worker] = field(default_factory=list)  # take no new requests now: their unstarted go elsewhere
    capacity: bool = False  # usable capacity may have grown: place the unplaced requests, wake every loop
    start: list[Worker] = field(default_factory=list)  # usable attention workers whose loop is not running
    clocks: list[Worker] = field(default_factory=list)  # their clocks are sent now, not at the next window
    whole: list[Worker] = field(default_factory=list)  # now `colocated`, with no FFN worker: they are told so


class Membership:
    """The registry's keeper: turns control messages into registry updates and `Change`s."""

    def __init__(self, registry: Registry, scheduler_id: str, run_token: str, *, colocate_alone: bool = False) -> None:
        self.registry, self.scheduler_id, self.run_token = registry, scheduler_id, run_token
        # `provision_kinds colocated`: a worker holding both halves that registers with no FFN worker there
        # serves the whole model at once, as the first plan would make it (`aflex up` on a CPU host has none)
        self.colocate_alone = colocate_alone

    def register_reply(self, ok: bool, error: str | None = None, *, drained: bool | None = None) -> bytes:
        body = None if error is None else ErrorBody(type=ErrorType.INVALID_REQUEST, message=error)
        return encode(RegisterReply(ok=ok, scheduler_id=self.scheduler_id, error=body,
                                    scheduler_instance=self.run_token, drained=drained))

    def register(self, data: bytes, now: float) -> tuple[bytes, Change]:
        """A worker (re)registers: the reply to send it, and what its arrival changes."""
        try:
            reg = decode(Register, data)
            subjects.check_token(reg.worker_id)
        except (ProtocolError, ValueError) as exc:
            return self.register_reply(False, str(exc)), Change()
        worker, restarted = self.registry.register(reg, now)
        log.info("worker %s (%s) registered%s", reg.worker_id, reg.role, " again: restarted" if restarted else "")
        change = Change(joined=[worker], clocks=[worker])
        if self.colocate_alone and worker.can_colocate and worker.assignment is None \
                and not self.registry.healthy("ffn"):
            worker.assignment = "colocated"  # no FFN worker to split with (`aflex up` on a CPU host): all here
            change.whole.append(worker)
            log.info("worker %s serves the whole model: no FFN worker is registered", worker.worker_id)
        change = self._capacity(change)
        if worker.role == "attention" and restarted:
            change.restarted.append(worker)
        return self.register_reply(True), change

    def heartbeat(self, hb: Heartbeat, now: float, in_flight: Callable[[str], bool]) -> tuple[bytes | None, Change]:
        """A worker's heartbeat: a reply asking it to register again (this scheduler does not know it
        as registered, e.g. it is new), or telling a draining worker whether it is drained, or None; and
        what its liveness changes. A worker that starts draining takes no new work from now on: its
        unstarted requests go elsewhere, what it holds finishes there (as when it is parked)."""
        worker, revived = self.registry.heartbeat(hb, now)
        change = Change()
        if hb.draining and not worker.draining:
            worker.draining = True
            log.info("worker %s (%s) is draining: no new work, what it holds finishes", worker.worker_id,
                     worker.role)
            change.reroute = [worker] if worker.attention_lane is not None else []
        if not worker.registered:
            reply: bytes | None = self.register_reply(False)
        elif hb.draining:
            reply = self.register_reply(True, drained=self.registry.drained(worker, in_flight))
        else:
            reply = None
        if not revived:
            return reply, change
        log.info("worker %s is healthy again", worker.worker_id)
        return reply, self._capacity(change)

    def expire(self, now: float, timeout_s: float) -> Change:
        """The workers silent for longer than `timeout_s` are lost."""
        lost = self.registry.expire(now, timeout_s)
        for worker in lost:
            log.warning("worker %s (%s) missed heartbeats for %.1f s: unhealthy", worker.worker_id, worker.role,
                        timeout_s)
        return Change(lost=lost)

    def plan_changed(self, changed: list[Worker]) -> Change:
        """The global scheduler moved `changed`: a parked attention worker, or a decode worker of a P/D plan,
        takes no new requests (what it holds finishes there), woken ones start taking work, and every
        changed worker gets its clocks now rather than at the next frequency window."""
        reroute = [w for w in changed if w.attention_lane is not None
                   and (w.parked or decodes_only(w.assignment))]
        return self._capacity(Change(reroute=reroute, clocks=list(changed)))

    def _capacity(self, change: Change) -> Change:
        """`change`, with the capacity grown: every usable attention worker without a running loop gets one."""
        change.capacity = True
        change.start = [w for w in self.registry.usable_attention() if w.lane.task is None or w.lane.task.done()]
        return change

    def status(self, model_id: str, queue_depth: int, running: int, now: float) -> SchedulerStatus:
        """The answer to a status request: readiness, every worker known, the queue."""
        return SchedulerStatus(ready=self.registry.ready, scheduler_id=self.scheduler_id, model_id=model_id,
                               workers=[w.info(now) for w in self.registry.workers.values()],
                               queue_depth=queue_depth, running=running)

"""A worker's presence: registration with the scheduler, then heartbeats; and the role it is assigned.

A worker is useless until the scheduler knows it, so it registers (request/reply on
`control.register`) right after it subscribes to its microbatch subject, retrying until a scheduler
answers or the registration timeout passes. Heartbeats are sent as requests: NATS answers a request
nobody subscribes to with "no responders" at once, which is how a worker notices that the
scheduler is gone (restarted) and registers again. A scheduler may reply to a heartbeat with a
`RegisterReply(ok=False)` to ask an unknown worker to register again; it need not reply at all.
A stopping worker drains (`Presence.drain`): its heartbeats say `draining`, the scheduler sends it no
new work, and it asks on `control.drain.<wid>` (where only the scheduler listens) until the scheduler
answers that what it placed here has finished.
The global scheduler's `RoleAssignment`s come on `control.role.<wid>`: `RoleFollower` takes them
(the telemetry's assignment, and the worker's cold parking).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from nats.aio.client import Client
from nats.aio.msg import Msg

from shared import subjects
from shared.errors import AFlexError
from shared.gpu.telemetry import WorkerMeter
from shared.kinds import Assignment, Role
from shared.messages import Heartbeat, ProtocolError, Register, RegisterReply, RoleAssignment, decode, encode
from shared.transport import bus

if TYPE_CHECKING:
    from nats.aio.subscription import Subscription

    from shared.gpu.base import GPU

log = logging.getLogger("aflex.worker")

REGISTER_ATTEMPT_TIMEOUT_S = 2.0  # one registration request; retried until register_timeout_s
REGISTER_RETRY_WAIT_S = 0.5  # pause after "no responders" (no scheduler subscribed yet)
HEARTBEAT_REPLY_WAIT_S = 0.25  # how long a heartbeat waits for an (optional) scheduler reply
DRAIN_REPLY_WAIT_S = 1.0  # a drain request waits this long for the scheduler's answer (then asks again)
DRAIN_POLL_S = 0.2  # how often a draining worker asks until drained


class RegistrationError(AFlexError):
    """No scheduler accepted this worker: none answered in time, or it refused the worker."""


async def wait_stop(stop: asyncio.Event, timeout_s: float) -> bool:
    """Sleep up to `timeout_s`, waking early when `stop` is set; returns whether it is set."""
    if timeout_s > 0 and not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout_s)
    return stop.is_set()


def registration(worker_id: str, role: Role, model_id: str, n_layers: int, *,
                 kv_total_blocks: int = 0, block_size: int = 0, max_seq_len: int = 0,
                 gpu: GPU | None = None, seam_address: str = "", kv_address: str = "",
                 halves: list[Role] | None = None, group_devices: list[str] | None = None) -> Register:
    return Register(worker_id=worker_id, role=role, model_id=model_id, n_layers=n_layers,
                    kv_total_blocks=kv_total_blocks, block_size=block_size, max_seq_len=max_seq_len,
                    pid=os.getpid(), started_ts=time.time(),
                    gpu_backend=gpu.backend if gpu is not None else "",
                    gpu_name=gpu.name if gpu is not None else "",
                    gpu_profile=str(getattr(getattr(gpu, "profile", None), "key", "")),
                    supported_clocks_mhz=list(gpu.supported_sm_clocks_mhz()) if gpu is not None else [],
                    seam_address=seam_address, kv_address=kv_address, halves=halves or [],
                    group_devices=group_devices or [],
                    gpu_memory_bytes=gpu.memory_bytes() if gpu is not None else 0.0)


class Presence:
    """Registration with retry, then a heartbeat every period (re-registering when the scheduler is gone)."""

    def __init__(self, nc: Client, message: Register, heartbeat: Callable[[], Heartbeat], *,
                 period_s: float, register_timeout_s: float, on_new_scheduler: Callable[[], None] | None = None
                 ) -> None:
        self.nc, self.message, self.heartbeat = nc, message, heartbeat
        self.period_s, self.register_timeout_s = period_s, register_timeout_s
        self.on_new_scheduler = on_new_scheduler  # registered with another scheduler run than before
        self.registered = False
        self.draining = False  # set by `drain`: every heartbeat from then on says so
        self.scheduler_id: str | None = None
        self.scheduler_instance: str | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._halt = asyncio.Event()  # ends the heartbeats (`stop`): they go on while the worker drains

    async def start(self, stop: asyncio.Event) -> bool:
        """Register (see `register`), then heartbeat in the background until `stop()` (a worker that is
        asked to stop drains first, heartbeats going on); False when `stop` was set before a scheduler
        accepted us."""
        if await self.register(stop) is None:
            return False
        self._heartbeat_task = asyncio.create_task(self.heartbeat_loop(self._halt))
        return True

    async def stop(self) -> None:
        """Stop heartbeating: the scheduler then stops sending (and, once they time out, takes back what is here)."""
        self._halt.set()
        task, self._heartbeat_task = self._heartbeat_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _attempt(self, timeout_s: float) -> RegisterReply | None:
        """One registration request: the reply, or None when nobody answered (raises if refused)."""
        try:
            data = await bus.request(self.nc, subjects.CONTROL_REGISTER, encode(self.message), timeout_s)
            reply = decode(RegisterReply, data)
        except (bus.NoRespondersBusError, bus.BusTimeoutError):
            return None
        except ProtocolError as exc:
            log.warning("%s: bad registration reply: %s", self.message.worker_id, exc)
            return None
        except Exception as exc:  # connection lost or closing: transient, retried
            log.warning("%s: registration request failed: %s", self.message.worker_id, exc)
            return None
        if not reply.ok:
            reason = reply.error.message if reply.error else "no reason given"
            raise RegistrationError(f"scheduler {reply.scheduler_id} refused worker "
                                    f"{self.message.worker_id}: {reason}")
        self.registered, self.scheduler_id = True, reply.scheduler_id
        before, self.scheduler_instance = self.scheduler_instance, reply.scheduler_instance
        if before is not None and before != reply.scheduler_instance and self.on_new_scheduler is not None:
            self.on_new_scheduler()  # the new run knows nothing of what the old one placed here
        return reply

    async def register(self, stop: asyncio.Event) -> RegisterReply | None:
        """Retry until a scheduler accepts us; None if `stop` was set first; raises `RegistrationError`."""
        deadline = time.monotonic() + self.register_timeout_s
        while not stop.is_set():
            remaining = deadline - time.monotonic()
            reply = await self._attempt(max(0.05, min(REGISTER_ATTEMPT_TIMEOUT_S, remaining)))
            if reply is not None:
                log.info("%s: registered with scheduler %s", self.message.worker_id, reply.scheduler_id)
                return reply
            if time.monotonic() >= deadline:
                raise RegistrationError(f"worker {self.message.worker_id}: no scheduler answered on "
                                        f"{subjects.CONTROL_REGISTER} within {self.register_timeout_s:.0f} s")
            await wait_stop(stop, min(REGISTER_RETRY_WAIT_S, max(0.0, deadline - time.monotonic())))
        return None

    async def drain(self, timeout_s: float) -> bool:
        """SIGTERM: say `draining` in every heartbeat (the scheduler sends no new work here) until the scheduler
        answers that nothing it placed here is left, or no scheduler is there to send any, or `timeout_s`
        passes. True when drained in time."""
        self.draining = True
        role, worker_id = self.message.role, self.message.worker_id
        log.info("%s worker %s draining (up to %g s)", role, worker_id, timeout_s)
        subject = subjects.drain(worker_id)  # only the scheduler answers there
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reply = decode(RegisterReply, await bus.request(self.nc, subject, encode(self._message()),
                                                                DRAIN_REPLY_WAIT_S))
                drained = reply.drained or not reply.ok  # a scheduler that does not know us placed nothing here
            except bus.NoRespondersBusError:  # no scheduler: nothing more comes, nothing is waited for
                drained = True
            except Exception as exc:  # not answered in time (busy, or disconnected): ask again
                log.debug("%s: drain request not answered: %s", worker_id, exc)
                drained = False
            if drained:
                log.info("%s worker %s drained", role, worker_id)
                return True
            if time.monotonic() >= deadline:
                log.warning("%s: not drained within drain_timeout_s=%g", worker_id, timeout_s)
                return False
            await asyncio.sleep(DRAIN_POLL_S)

    def _message(self) -> Heartbeat:
        beat = self.heartbeat()
        return beat.model_copy(update={"draining": True}) if self.draining else beat

    async def _beat(self) -> bool:
        """Send one heartbeat; False when no scheduler is there (or it asks us to register again)."""
        subject = subjects.heartbeat(self.message.worker_id)
        try:
            data = await bus.request(self.nc, subject, encode(self._message()),
                                     min(HEARTBEAT_REPLY_WAIT_S, self.period_s / 2))
        except bus.NoRespondersBusError:
            return False
        except bus.BusTimeoutError:  # heard, not answered: the normal case
            return True
        except Exception as exc:  # disconnected: nats-py reconnects; do not re-register for that
            log.debug("%s: heartbeat not sent: %s", self.message.worker_id, exc)
            return True
        try:
            return decode(RegisterReply, data).ok
        except ProtocolError:
            return True

    async def heartbeat_loop(self, stop: asyncio.Event) -> None:
        next_at = time.monotonic()
        while True:
            next_at += self.period_s
            if await wait_stop(stop, next_at - time.monotonic()):
                return
            try:
                if not await self._beat():
                    if self.registered:
                        log.warning("%s: no scheduler heard the heartbeat; registering again",
                                    self.message.worker_id)
                    self.registered = False
                if not self.registered and await self._attempt(min(REGISTER_ATTEMPT_TIMEOUT_S, self.period_s)):
                    log.info("%s: registered again with scheduler %s", self.message.worker_id, self.scheduler_id)
            except RegistrationError as exc:
                log.error("%s", exc)
            except Exception:  # the heartbeat must never die
                log.exception("%s: heartbeat failed", self.message.worker_id)


class RoleFollower:
    """The worker's end of `control.role.<wid>`: each assignment goes to the meter (telemetry carries it)
    and to `on_assignment` (cold parking releases or loads the weights)."""

    def __init__(self, worker_id: str, meter: WorkerMeter, on_assignment: Callable[[Assignment | None], None]) -> None:
        self.worker_id, self.meter, self.on_assignment = worker_id, meter, on_assignment
        self._sub: Subscription | None = None

    async def start(self, nc: Client) -> None:
        """Follow assignments from now on: before registering, so the first plan that names us is heard."""
        self._sub = await nc.subscribe(subjects.role(self.worker_id), cb=self._on_role)

    async def _on_role(self, msg: Msg) -> None:
        try:
            role = decode(RoleAssignment, msg.data)
        except ProtocolError as exc:
            log.warning("%s: ignored a malformed role assignment: %s", self.worker_id, exc)
            return
        if role.worker_id != self.worker_id:
            log.warning("%s: ignored a role assignment for worker %s", self.worker_id, role.worker_id)
            return
        if role.assignment != self.meter.assignment:
            log.info("%s: %s (plan %d: %s)", self.worker_id, role.assignment, role.plan_id, role.reason)
        self.meter.assignment = role.assignment
        self.on_assignment(role.assignment)

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):  # connection already gone
                await sub.unsubscribe()

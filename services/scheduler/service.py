"""The scheduler service: the bus's control and request subjects, and who acts on what each answers.

`Scheduler` subscribes to registrations, heartbeats, status requests, submissions, cancellations and
`MicrobatchDone`s, and runs the health loop and the frequency window. It decides nothing itself; it
applies what the deciding modules answer: membership.py's `Change` for each registration, heartbeat,
silence and new plan (lanes to start, requests to route again, workers lost, clocks to send);
admission.py's refusals (at submission, and `shed` past the queue deadline); governor.py's clock
commands. It assembles the telemetry from the figures' owners (`telemetry`). dispatch.py runs the
per-worker iterations, applies recovery.py's verdicts and streams the tokens; its `finish` is the one
place a request ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.scheduler import beacon, recovery
from services.scheduler.admission import RETRY_AFTER_S, Mesh, rejection, shed, unserved
from services.scheduler.aflex import AflexPlanner
from services.scheduler.batching import BatchingPolicy
from services.scheduler.dispatch import Dispatch
from services.scheduler.gateways import GatewayWatch
from services.scheduler.governor import Governor
from services.scheduler.membership import Change, Membership
from services.scheduler.model_info import ModelInfo
from services.scheduler.plan_loop import ProvisioningLoop
from services.scheduler.prefix_index import PrefixIndex
from services.scheduler.profiles import Profiles
from services.scheduler.registry import Registry, Worker
from services.scheduler.routing import Placement
from services.scheduler.slo_watch import SloWatch
from services.scheduler.state import RequestState
from services.scheduler.tasks import TaskSet
from shared import subjects
from shared.error_types import ErrorType
from shared.messages import (
    CancelRequest,
    ErrorBody,
    Heartbeat,
    ProtocolError,
    Register,
    RoleAssignment,
    SchedulerTelemetry,
    SubmitReply,
    SubmitRequest,
    decode,
    encode,
)
from shared.policy.iteration import parse_depth, planner_depths
from shared.settings import SchedulerSettings
from shared.transport import bus

log = logging.getLogger("aflex.scheduler")

DRAIN_POLL_S = 0.1  # how often a draining scheduler looks whether its requests have finished
WARM_WAIT_S = 1.0  # how long a registration waits for its GPU profile's fits (under presence.py's 2 s attempt)


class Scheduler:
    def __init__(self, settings: SchedulerSettings, nc: Client, model: ModelInfo) -> None:
        self.settings, self.nc, self.model = settings, nc, model
        self.registry = Registry()
        self.requests: dict[str, RequestState] = {}
        self.prefixes = PrefixIndex() if settings.prefix_caching else None
        self.placement = Placement(self.registry, self.prefixes)
        self.run_token = uuid.uuid4().hex[:8]  # this run: mb ids unique across restarts, the heartbeat's instance
        self.tasks = TaskSet()
        self.profiles = Profiles()
        self.slo = SloWatch(settings)
        planner = aflex_planner(settings, model)
        self.governor = Governor(settings, self.registry, planner, self.profiles, self.slo)
        self.batching = BatchingPolicy(settings, self.registry, planner, self.profiles)
        self.gateways = GatewayWatch(settings.gateway_silence_s)
        self.membership = Membership(self.registry, settings.scheduler_id, self.run_token,
                                     colocate_alone=settings.provision_kinds == "colocated")
        self.provisioning = ProvisioningLoop(settings, nc, self.registry, self.governor, self.profiles,
                                             self._plan_changed) if settings.provisioning == "aflex" else None
        self._submissions: Subscription | None = None
        self._unserved_since: float | None = None  # when the mesh last lost its last FFN (`unserved`), None: it has one
        self.dispatch = Dispatch(settings, nc, model, self.registry, self.requests, self.placement, self.prefixes,
                                 self.governor, self.batching, self.slo, self.provisioning, self.tasks,
                                 self.run_token)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        nc = self.nc
        await nc.subscribe(subjects.CONTROL_REGISTER, cb=bus.guarded(self._on_register, log))
        await nc.subscribe(subjects.CONTROL_HEARTBEAT_ALL, cb=bus.guarded(self._on_heartbeat, log))
        await nc.subscribe(subjects.CONTROL_DRAIN_ALL, cb=bus.guarded(self._on_heartbeat, log))  # draining ones
        await nc.subscribe(subjects.SCHED_DONE, cb=bus.guarded(self.dispatch.on_done, log))
        await nc.subscribe(subjects.SCHED_STATUS, cb=bus.guarded(self._on_status, log))
        self._submissions = await nc.subscribe(subjects.REQ_SUBMIT, queue=subjects.SCHEDULER_QUEUE,
                                               cb=bus.guarded(self._on_submit, log))
        await nc.subscribe(subjects.REQ_CANCEL_ALL, cb=bus.guarded(self._on_cancel, log))
        await nc.subscribe(subjects.GATEWAY_HEARTBEAT, cb=bus.guarded(self.gateways.on_heartbeat, log))
        await nc.flush()
        self.tasks.spawn(self._health_loop())
        if self.settings.freq_window_s > 0:
            self.tasks.spawn(self._freq_loop())
        if self.provisioning is not None:
            self.tasks.spawn(self.provisioning.run())
        s = self.settings
        self.tasks.spawn(beacon.heartbeat_loop(nc, s.scheduler_id, self.run_token, s.heartbeat_s))
        if s.telemetry_hz > 0:
            self.tasks.spawn(beacon.telemetry_loop(nc, s.scheduler_id, s.telemetry_hz, self.telemetry))

    async def stop(self) -> None:
        await self.tasks.cancel_all()

    async def drain(self, timeout_s: float) -> bool:
        """SIGTERM: take no new requests (submissions go to another scheduler of the queue group, or wait for
        one), and let the admitted ones finish; True when they all did within `timeout_s`. It stops waiting
        early when no attention worker is left to finish them (they would only be shed)."""
        if self._submissions is not None:
            await self._submissions.unsubscribe()
            self._submissions = None
        deadline = time.monotonic() + timeout_s
        while (left := [s for s in self.requests.values() if not s.finished]) and self.registry.healthy("attention"):
            if time.monotonic() >= deadline:
                log.warning("scheduler %s: %d requests not finished within drain_timeout_s=%g",
                            self.settings.scheduler_id, len(left), timeout_s)
                return False
            await asyncio.sleep(DRAIN_POLL_S)
        return not left

    @property
    def queue_depth(self) -> int:
        return len(self.placement.unplaced) + sum(len(lane.waiting) for lane in self.registry.lanes())

    @property
    def running_count(self) -> int:
        return sum(len(lane.running) for lane in self.registry.lanes())

    def telemetry(self) -> SchedulerTelemetry:
        """What the scheduler publishes `telemetry_hz` times a second, from the figures' owners: the SLO watch's
        attainment and p90s, the governor's clocks, each healthy attention worker's queue and running set, the
        assignments and plan, the KV handoffs."""
        slo = self.slo.figures(time.monotonic())
        workers = self.registry.healthy("attention")
        return SchedulerTelemetry(
            scheduler_id=self.settings.scheduler_id, ts=time.time(), queue_depth=self.queue_depth,
            running=self.running_count, finished=slo.finished, slo_attainment=slo.attainment,
            ttft_p90_ms=slo.ttft_p90_ms, tpot_p90_ms=slo.tpot_p90_ms, clocks_mhz=self.governor.clocks_mhz(),
            assignments={w.worker_id: w.assignment for w in self.registry.workers.values()
                         if w.healthy and w.assignment is not None},
            plan_id=self.provisioning.plan_id if self.provisioning else 0,
            waiting_by_worker={w.worker_id: len(w.lane.waiting) for w in workers},
            running_by_worker={w.worker_id: len(w.lane.running) for w in workers},
        ).model_copy(update=self.dispatch.handoffs.figures())

    # -- membership (membership.py answers, the scheduler applies) -------------------------------

    async def _on_register(self, msg: Msg) -> None:
        await self._warm_planner(msg.data)
        reply, change = self.membership.register(msg.data, time.monotonic())
        self._apply_change(change)
        await msg.respond(reply)
        for worker in change.whole:  # as a plan would tell it (its telemetry, `aflex top`, say `colocated`)
            await self.nc.publish(subjects.role(worker.worker_id), encode(RoleAssignment(
                worker_id=worker.worker_id, assignment="colocated", plan_id=0, issued_ts=time.time(),
                reason="the whole model here: no FFN worker is registered")))

    async def _warm_planner(self, data: bytes) -> None:
        """Fit the planner's tables for a registering worker's GPU before it joins (~0.6 s, the first worker of
        a GPU profile only), so that no request waits for them on this loop. Waited for at most
        `WARM_WAIT_S`, under a registration attempt's timeout (a slow fit goes on in its thread), and a fit that
        fails only logs: the worker registers anyway."""
        planner = self.governor.planner
        if planner is None:
            return
        try:
            register = decode(Register, data)
        except ProtocolError:  # membership.register answers a malformed registration
            return
        profile = self.profiles.named(register.gpu_profile, register.gpu_name)
        if profile is None:
            return
        fitting = asyncio.ensure_future(asyncio.to_thread(planner.warm, profile))
        try:
            await asyncio.wait_for(asyncio.shield(fitting), WARM_WAIT_S)
        except TimeoutError:
            fitting.add_done_callback(lambda done: done.cancelled() or done.exception())  # always retrieved
            log.info("scheduler: the %s tables take over %g s to fit; %s registers meanwhile", profile.name,
                     WARM_WAIT_S, register.worker_id)
        except Exception as exc:  # a planner that cannot fit must not keep a worker out
            log.warning("scheduler: fitting the %s tables failed (%s); %s registers anyway", profile.name, exc,
                        register.worker_id)

    async def _on_heartbeat(self, msg: Msg) -> None:
        hb = decode(Heartbeat, msg.data)
        now = time.monotonic()
        reply, change = self.membership.heartbeat(hb, now, self.dispatch.in_flight.holds)
        if reply is not None and msg.reply:
            await msg.respond(reply)
        self._apply_change(change)
        if hb.active_mb_ids is not None:
            self.dispatch.in_flight.check_heartbeat(hb.worker_id, set(hb.active_mb_ids), now,
                                                    self.settings.microbatch_lost_after_s, hb.newest_mb_id)

    async def _on_status(self, msg: Msg) -> None:
        status = self.membership.status(self.model.model_id, self.queue_depth, self.running_count, time.monotonic())
        await msg.respond(encode(status))

    def _plan_changed(self, changed: list[Worker]) -> None:
        self._apply_change(self.membership.plan_changed(changed))

    def on_bus_lost(self) -> None:
        """The NATS connection dropped: every in-flight microbatch is a suspect the next heartbeat settles."""
        self.dispatch.in_flight.bus_lost()

    def _apply_change(self, change: Change) -> None:
        """Act on membership's answer: take back what lost or restarted workers held (their KV is gone or out of
        reach; no prefix is looked for there), route requests around workers that take none, start lanes."""
        for worker, restarted in [*((w, False) for w in change.lost), *((w, True) for w in change.restarted)]:
            if worker.role == "attention":
                recovery.lose(worker, self.dispatch.in_flight, restarted=restarted)
                if self.prefixes is not None:
                    self.prefixes.lost(worker.worker_id)
        for worker in change.lost:
            if self.provisioning is not None:
                self.provisioning.lost(worker)
        for worker in change.joined:
            self.governor.worker_restarted(worker.worker_id)
        for worker in change.reroute:
            assert worker.attention_lane is not None  # membership reroutes attention workers only
            self.placement.reroute_unstarted(worker.attention_lane)
        for worker in change.start:
            self.dispatch.start_lane(worker)
        if change.capacity:
            unplaced, self.placement.unplaced = self.placement.unplaced, []
            for state in unplaced:
                self.placement.route(state)
            for worker in self.registry.healthy("attention"):
                worker.lane.wake.set()
        if change.clocks and self.settings.freq_window_s > 0:
            self.tasks.spawn(self.freq_window(change.clocks))

    async def _health_loop(self) -> None:
        """Every moment: lose the silent workers, abort the requests of silent gateways, shed the overdue."""
        timeout_s = self.settings.heartbeat_timeout_s
        while True:
            await asyncio.sleep(min(0.5, timeout_s / 4))
            self._apply_change(self.membership.expire(time.monotonic(), timeout_s))
            for state in self.gateways.orphans(time.monotonic(), list(self.requests.values())):
                if not state.finished:  # (finished meanwhile, while a delta was published)
                    await self.dispatch.finish(state, "abort")
            now = time.monotonic()
            if self.registry.can_serve:
                self._unserved_since = None
            elif self._unserved_since is None:
                self._unserved_since = now
                log.warning("no attention worker has an FFN for its microbatches: running requests end in %g s "
                            "unless one comes", self.settings.unserved_bound_s)
            for state, error in unserved(list(self.requests.values()), self._unserved_since, now,
                                         self.settings.unserved_bound_s):
                log.info("request %s ended: %s", state.request_id, error.message)
                await self._refuse(state, error)
            for state, error in shed(list(self.requests.values()), time.monotonic(), self.settings.queue_deadline_s,
                                     ready=self.registry.ready):
                log.info("request %s shed: %s", state.request_id, error.message)
                await self._refuse(state, error)

    async def _refuse(self, state: RequestState, error: ErrorBody) -> None:
        """End `state` with `error` (503 or 429 with Retry-After where nothing streamed yet)."""
        if state.finished:  # (finished meanwhile, while a delta was published)
            return
        try:
            await self.dispatch.finish(state, "error", error, retry_after_s=RETRY_AFTER_S)
        except Exception as exc:  # a publish into a closed connection: the health loop must go on
            log.warning("request %s: its refusal could not be sent: %s", state.request_id, exc)

    # -- admission ------------------------------------------------------------------------------

    async def _on_submit(self, msg: Msg) -> None:
        try:
            req = decode(SubmitRequest, msg.data)
        except ProtocolError as exc:
            await msg.respond(encode(SubmitReply(request_id="", accepted=False, error=ErrorBody(
                type=ErrorType.INVALID_REQUEST, message=str(exc), code="invalid_message"))))
            return
        outputs = self.dispatch.outputs
        known = (self.requests.get(req.request_id) or outputs.finished(req.request_id)) if req.resync else None
        if known is not None:  # its gateway may have missed deltas: send them again
            sent = await outputs.resend(known, req.first_index)
            log.info("request %s: sent %d deltas again from index %d", req.request_id, sent, req.first_index)
            self.gateways.heard(req.gateway_id, time.monotonic())
            reply = SubmitReply(request_id=req.request_id, accepted=True, scheduler_instance=self.run_token)
        else:
            reply = self._admit(req)
        await msg.respond(encode(reply))

    def _admit(self, req: SubmitRequest) -> SubmitReply:
        limit = min(self.registry.context_limit(), self.model.max_seq_len or 1 << 62)  # 0: the card says none
        refused = rejection(req, Mesh(self.requests, self.registry.ready, limit, self.model.vocab_size,
                                      self.queue_depth, self.settings.max_queue))
        if refused is not None:
            error, retry_after_s = refused
            return SubmitReply(request_id=req.request_id, accepted=False, retry_after_s=retry_after_s, error=error)
        state = RequestState(req.request_id, list(req.prompt_ids), req.sampling, req.arrival_ts,
                             output_ids=list(req.generated_ids), next_index=req.first_index,  # a continuation
                             base_index=req.first_index, base_tokens=len(req.generated_ids),
                             gateway_id=req.gateway_id, choice_of=req.fork_of, priority=req.priority)
        self.gateways.heard(req.gateway_id, time.monotonic())
        self.requests[req.request_id] = state
        self.placement.admit(state, self.requests.get(req.fork_of) if req.fork_of else None)
        if self.provisioning is not None:
            self.provisioning.admitted(state)
        return SubmitReply(request_id=req.request_id, accepted=True, scheduler_instance=self.run_token)

    # -- cancellation ---------------------------------------------------------------------------

    async def _on_cancel(self, msg: Msg) -> None:
        cancel = decode(CancelRequest, msg.data)
        state = self.requests.get(cancel.request_id)
        if state is None or state.finished or cancel.arrival_ts not in (None, state.arrival_ts):
            return  # unknown, done, or another submission under the same id
        log.info("request %s cancelled: %s", state.request_id, cancel.reason)
        await self.dispatch.finish(state, "abort")

    # -- frequency commands and telemetry (governor.py decides, dispatch publishes) -----------------

    async def _freq_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.freq_window_s)
            await self.freq_window()

    async def freq_window(self, only: list[Worker] | None = None) -> None:
        """One frequency window: the governor's command for every healthy worker with supported clocks; with
        `only`, a command for those workers now (their assignment changed), the window's plans unchanged."""
        for cmd in self.governor.commands(time.monotonic(), self.requests.values(), only):
            await self.nc.publish(subjects.freq(cmd.worker_id), encode(cmd))



def aflex_planner(settings: SchedulerSettings, model: ModelInfo) -> AflexPlanner | None:
    """aflex's predictors and margins, where a setting uses them: they price the prefill cap (`--batching aflex`)
    and pick the clocks (`--freq-policy aflex`); the governor corrects them from every microbatch's timings.
    None when neither setting asks, or the model's shape is unknown."""
    if settings.freq_policy != "aflex" and settings.batching != "aflex":
        return None
    if model.args is None:
        log.warning("aflex: the shape of model %s is unknown; no prefill cap, clocks fall back to slo", model.model_id)
        return None
    return AflexPlanner(model.args, ttft_slo_ms=settings.ttft_slo_ms, tpot_slo_ms=settings.tpot_slo_ms,
                        depths=planner_depths(parse_depth(settings.microbatch_depth)),
                        link_bytes_s=settings.freq_link_gbs * 1e9, max_batch_tokens=settings.max_batch_tokens)

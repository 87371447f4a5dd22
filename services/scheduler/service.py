"""The scheduler service: admission, routing, per-worker iteration loops, streaming, failures.

One asyncio task per attention worker runs iterations: plan (batcher.py), publish the
microbatch descriptors, wait for every `MicrobatchDone`, apply the sampled tokens, stream
`OutputDelta`s. Everything runs on one event loop, so request state needs no locks; NATS
callbacks only mutate state and set events, the loops do the waiting.

Failure model: a request's token history lives here, a worker's KV is disposable. A sequence the
worker refuses (`failed_seq_ids`, e.g. KV exhausted), a microbatch that errs or times out, and an
attention worker that stops heartbeating or restarts all lead to the same thing: the sequence is
re-routed and recomputed from its prompt + output tokens. After MAX_FAILURES errors (not KV
refusals) a request ends with finish_reason "error".

Energy: each `MicrobatchDone.energy_j` is shared among the sequences of that microbatch in
proportion to the tokens each fed in the pass; a request's shares add up to its `Usage.energy_j`.
Clocks: every `freq_window_s` each healthy worker with supported clocks gets a `FrequencyCommand`.
With the default policy `aflex` (aflex.py) the clocks come from shared/policy's clock selection (the
simulator's `aflex` rule: decode iterations by energy above the idle floor) on the iterations each
attention worker ran in the window, under SLO margins fed by the TTFT/TPOT observed in it;
`MicrobatchDone` timings correct its predictors online, and its depth choice sets the microbatch
depth when `microbatch_depth` is "auto". A worker whose GPU profile is unknown (or a
model whose shape is unknown) falls back to `slo`; `max`, `fixed` and `slo` are clocks.py's.
Batching under `aflex` is the simulator's too (batcher.py): waiting prompts shortest first with aging
(on `time.monotonic()`, from each request's `received_mono`), and, where the worker's profile and the
model's shape are known, an iteration's prefill tokens capped by `AflexPlanner.prefill_tokens`; the
other policies keep first-come first-served within `max_batch_tokens`. Telemetry: a
`SchedulerTelemetry` at `telemetry_hz` (queue, running, finished, SLO attainment, p90s, clocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, NamedTuple

from nats.aio.client import Client
from nats.aio.msg import Msg

from services.scheduler.admission import validate_request
from services.scheduler.aflex import (
    BATCHING,
    AflexPlanner,
    IterationSample,
    PairPlan,
    guess_profile,
    sample_of,
    serving_order,
)
from services.scheduler.batcher import (
    Pass,
    PrefillCap,
    microbatch_depth,
    phase_of,
    plan_iteration,
    split_microbatches,
)
from services.scheduler.clocks import PHASES, PhaseSignal, parse_fixed_clocks, percentile, plan_clocks, snap_up
from services.scheduler.model_info import ModelInfo, load_model_info
from services.scheduler.registry import Registry, Worker
from services.scheduler.state import RequestState, Status
from shared import bus, subjects
from shared.errors import AFlexError, InvalidRequestError
from shared.gpu.base import GPUError
from shared.gpu.emulated import GPUProfile, available_profiles, load_profile
from shared.messages import (
    CancelRequest,
    ClockPhase,
    ErrorBody,
    FinishReason,
    FrequencyCommand,
    Heartbeat,
    MicrobatchDescriptor,
    MicrobatchDone,
    OutputDelta,
    ProtocolError,
    Register,
    RegisterReply,
    SchedulerStatus,
    SchedulerTelemetry,
    SubmitReply,
    SubmitRequest,
    Usage,
    decode,
    encode,
)
from shared.policy import BatchingRule
from shared.settings import SchedulerSettings

log = logging.getLogger("aflex.scheduler")

MAX_FAILURES = 3  # errored passes of one request before it ends with finish_reason "error"
RETRY_AFTER_S = 1.0  # what overloaded / unavailable rejections suggest
LOST_CONFIRM_S = 0.5  # how long a microbatch missing from a heartbeat has to turn up done before it is lost


class WorkerLostError(AFlexError):
    """The attention worker of an in-flight microbatch stopped heartbeating or restarted."""


class MicrobatchLostError(AFlexError):
    """A microbatch's descriptor or its MicrobatchDone was lost: its worker, alive, does not have it."""


class BusLostError(AFlexError):
    """The scheduler's NATS connection dropped while a microbatch was in flight: its result may be lost."""


class InFlight(NamedTuple):
    """A microbatch the scheduler sent and awaits."""

    worker_id: str
    done: asyncio.Future[MicrobatchDone]
    sent_at: float  # time.monotonic() its descriptor was published


@dataclass(frozen=True)
class Finished:
    """A finished request, kept for a window for SLO attainment and the clock feedback."""

    mono: float  # time.monotonic() when it finished
    reason: FinishReason
    ttft_ms: float | None
    tpot_ms: float | None


class Scheduler:
    def __init__(self, settings: SchedulerSettings, nc: Client, model: ModelInfo) -> None:
        self.settings, self.nc, self.model = settings, nc, model
        self.registry = Registry()
        self.requests: dict[str, RequestState] = {}
        self.unplaced: list[RequestState] = []  # waiting while no attention worker can take them
        self.futures: dict[str, InFlight] = {}  # mb_id -> its worker, its done future, when it was sent
        self._run_token = uuid.uuid4().hex[:8]  # keeps mb ids unique across scheduler restarts
        self._tasks: set[asyncio.Task[None]] = set()
        self.fixed_clocks = parse_fixed_clocks(settings.fixed_clocks)  # a bad spec fails at start
        self.commanded: dict[str, dict[ClockPhase, int]] = {}  # worker -> clocks of its latest command
        self.finished_total = 0
        self.finished_log: deque[Finished] = deque()
        self.ttft_log: deque[tuple[float, float]] = deque()  # (monotonic time of the first token, TTFT ms)
        # aflex clock policy: the planner, each attention worker's iterations of the window, latest plans
        self.aflex: AflexPlanner | None = None
        self.samples: dict[str, deque[IterationSample]] = {}
        self.plans: dict[str, dict[ClockPhase, PairPlan]] = {}
        self._profiles: dict[tuple[str, str], GPUProfile | None] = {}
        self._warned: set[str] = set()
        # aflex batching: shortest prompt first with aging (any worker); the prefill cap where predicted
        self.batching: BatchingRule | None = BATCHING if settings.freq_policy == "aflex" else None
        if settings.freq_policy == "aflex":
            if model.args is None:
                log.warning("clock policy aflex: the shape of model %s is unknown; every worker falls back to slo",
                            model.model_id)
            else:
                depth = settings.microbatch_depth
                self.aflex = AflexPlanner(model.args, ttft_slo_ms=settings.ttft_slo_ms,
                                          tpot_slo_ms=settings.tpot_slo_ms,
                                          depths=(1, 2, 3, 4) if depth == "auto" else (int(depth),),
                                          link_bytes_s=settings.freq_link_gbs * 1e9,
                                          max_batch_tokens=settings.max_batch_tokens)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        nc = self.nc
        await nc.subscribe(subjects.CONTROL_REGISTER, cb=self._guard(self._on_register))
        await nc.subscribe(subjects.CONTROL_HEARTBEAT_ALL, cb=self._guard(self._on_heartbeat))
        await nc.subscribe(subjects.SCHED_DONE, cb=self._guard(self._on_done))
        await nc.subscribe(subjects.SCHED_STATUS, cb=self._guard(self._on_status))
        await nc.subscribe(subjects.REQ_SUBMIT, queue=subjects.SCHEDULER_QUEUE, cb=self._guard(self._on_submit))
        await nc.subscribe(subjects.REQ_CANCEL_ALL, cb=self._guard(self._on_cancel))
        await nc.flush()
        self._spawn(self._health_loop())
        if self.settings.freq_window_s > 0:
            self._spawn(self._freq_loop())
        if self.settings.telemetry_hz > 0:
            self._spawn(self._telemetry_loop())

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("scheduler task %s died", task.get_name(), exc_info=task.exception())

    def _guard(self, handler: Callable[[Msg], Awaitable[None]]) -> Callable[[Msg], Awaitable[None]]:
        """Wrap a NATS callback: a malformed message is logged, never kills the subscription."""
        async def cb(msg: Msg) -> None:
            try:
                await handler(msg)
            except ProtocolError as exc:
                log.warning("dropped a message on %s: %s", msg.subject, exc)
            except Exception:
                log.exception("error handling a message on %s", msg.subject)
        return cb

    # -- control --------------------------------------------------------------------------------

    async def _on_register(self, msg: Msg) -> None:
        try:
            reg = decode(Register, msg.data)
            subjects.check_token(reg.worker_id)
        except (ProtocolError, ValueError) as exc:
            reply = RegisterReply(ok=False, scheduler_id=self.settings.scheduler_id,
                                  error=ErrorBody(type="invalid_request_error", message=str(exc)))
            await msg.respond(encode(reply))
            return
        worker, restarted = self.registry.register(reg, time.monotonic())
        log.info("worker %s (%s) registered%s", reg.worker_id, reg.role, " again: restarted" if restarted else "")
        if worker.role == "attention" and restarted:
            self._lose(worker, restarted=True)  # its KV is empty now: recompute what it held
        await msg.respond(encode(RegisterReply(ok=True, scheduler_id=self.settings.scheduler_id)))
        self._on_capacity_change()
        self.commanded.pop(worker.worker_id, None)  # a (re)started worker starts over, at max for "slo"
        if worker.supported_clocks_mhz and self.settings.freq_window_s > 0:
            await self._command(worker, self._signals(time.monotonic()))

    async def _on_heartbeat(self, msg: Msg) -> None:
        hb = decode(Heartbeat, msg.data)
        now = time.monotonic()
        worker, revived = self.registry.heartbeat(hb, now)
        if revived:
            log.info("worker %s is healthy again", worker.worker_id)
            self._on_capacity_change()
        if hb.active_mb_ids is not None:
            self._check_lost(hb.worker_id, set(hb.active_mb_ids), now)

    def _check_lost(self, worker_id: str, active: set[str], now: float) -> None:
        """Microbatches of `worker_id` sent over `microbatch_lost_after_s` ago that its heartbeat does not
        list are suspects; one still not done a moment later (a MicrobatchDone sent just before the
        heartbeat may still be in the scheduler's queue) was lost and fails now, not at its timeout."""
        grace = self.settings.microbatch_lost_after_s
        suspects = [mb_id for mb_id, (wid, fut, sent) in self.futures.items()
                    if wid == worker_id and not fut.done() and mb_id not in active and now - sent > grace]
        if suspects:
            asyncio.get_running_loop().call_later(LOST_CONFIRM_S, self._fail_lost, worker_id, suspects)

    def _fail_lost(self, worker_id: str, mb_ids: list[str]) -> None:
        for mb_id in mb_ids:
            entry = self.futures.get(mb_id)
            if entry is not None and not entry.done.done():
                entry.done.set_exception(MicrobatchLostError(
                    f"{worker_id} is alive but does not have microbatch {mb_id}: its descriptor or its "
                    "MicrobatchDone was lost"))

    def _on_capacity_change(self) -> None:
        """A worker joined or came back: place unplaced requests, start loops, wake every loop."""
        for worker in self.registry.usable_attention():
            if worker.task is None or worker.task.done():
                worker.task = self._spawn(self._worker_loop(worker))
        unplaced, self.unplaced = self.unplaced, []
        for state in unplaced:
            self._route(state)
        for worker in self.registry.healthy("attention"):
            worker.wake.set()

    async def _health_loop(self) -> None:
        timeout = self.settings.heartbeat_timeout_s
        while True:
            await asyncio.sleep(min(0.5, timeout / 4))
            for worker in self.registry.expire(time.monotonic(), timeout):
                log.warning("worker %s (%s) missed heartbeats for %.1f s: unhealthy", worker.worker_id,
                            worker.role, timeout)
                if worker.role == "attention":
                    self._lose(worker, restarted=False)

    def on_bus_lost(self) -> None:
        """The NATS connection dropped: a `MicrobatchDone` (or the descriptor itself) may have gone with
        it, so every in-flight microbatch is given up now and its sequences recompute (not counted as
        their failure), instead of waiting `microbatch_timeout_s` for a message that may never come."""
        for mb_id, (wid, fut, _) in list(self.futures.items()):
            if not fut.done():
                fut.set_exception(BusLostError(f"NATS connection lost while {wid} was running {mb_id}"))

    def _lose(self, worker: Worker, *, restarted: bool) -> None:
        """The worker's KV can no longer be trusted: fail its in-flight microbatches, let its loop evacuate."""
        worker.epoch += 1
        for mb_id, (wid, fut, _) in list(self.futures.items()):
            if wid == worker.worker_id and not fut.done():
                fut.set_exception(WorkerLostError(f"attention worker {wid} lost while running {mb_id}"))
        if restarted:
            worker.pending_release.clear()  # a restarted worker holds nothing to release
        worker.wake.set()

    async def _on_status(self, msg: Msg) -> None:
        now = time.monotonic()
        running = sum(len(w.running) for w in self.registry.workers.values())
        status = SchedulerStatus(ready=self.registry.ready, scheduler_id=self.settings.scheduler_id,
                                 model_id=self.model.model_id,
                                 workers=[w.info(now) for w in self.registry.workers.values()],
                                 queue_depth=self.queue_depth, running=running)
        await msg.respond(encode(status))

    @property
    def queue_depth(self) -> int:
        return len(self.unplaced) + sum(len(w.waiting) for w in self.registry.workers.values())

    # -- admission ------------------------------------------------------------------------------

    async def _on_submit(self, msg: Msg) -> None:
        try:
            req = decode(SubmitRequest, msg.data)
        except ProtocolError as exc:
            await msg.respond(encode(SubmitReply(request_id="", accepted=False, error=ErrorBody(
                type="invalid_request_error", message=str(exc), code="invalid_message"))))
            return
        reply = self._admit(req)
        await msg.respond(encode(reply))

    def _admit(self, req: SubmitRequest) -> SubmitReply:
        rid = req.request_id

        def reject(type_: str, message: str, code: str, param: str | None = None,
                   retry_after_s: float | None = None) -> SubmitReply:
            return SubmitReply(request_id=rid, accepted=False, retry_after_s=retry_after_s,
                               error=ErrorBody(type=type_, message=message, code=code, param=param))

        try:
            subjects.check_token(rid)
        except ValueError as exc:
            return reject("invalid_request_error", str(exc), "invalid_request_id", "request_id")
        if rid in self.requests:
            return reject("invalid_request_error", f"request {rid!r} is already running", "duplicate_request_id",
                          "request_id")
        if not self.registry.ready:
            return reject("service_unavailable_error", "no attention and FFN workers are ready yet", "503",
                          retry_after_s=RETRY_AFTER_S)
        limit = self.registry.context_limit()
        if self.model.max_seq_len:
            limit = min(limit, self.model.max_seq_len)
        try:
            validate_request(req, context_limit=limit, vocab_size=self.model.vocab_size)
        except InvalidRequestError as exc:
            return reject("invalid_request_error", str(exc), "invalid_value", exc.param)
        if self.queue_depth >= self.settings.max_queue:
            return reject("overloaded_error", f"the scheduler queue is full ({self.settings.max_queue} waiting "
                          "requests); retry later", "429", retry_after_s=RETRY_AFTER_S)
        state = RequestState(rid, list(req.prompt_ids), req.sampling, req.arrival_ts)
        self.requests[rid] = state
        self._route(state)
        return SubmitReply(request_id=rid, accepted=True)

    def _route(self, state: RequestState, *, front: bool = False) -> None:
        """Queue `state` on the attention worker with the most free KV (estimated), or leave it unplaced."""
        need = len(state.prompt_ids) + state.sampling.max_tokens
        worker = self.registry.best_attention(need)
        state.status = Status.WAITING
        if worker is None:
            state.worker_id = None
            self.unplaced.append(state)
            return
        state.worker_id = worker.worker_id
        worker.reserved_blocks[state.request_id] = worker.blocks_for(need)
        if front:
            worker.waiting.appendleft(state)
        else:
            worker.waiting.append(state)
        worker.wake.set()

    # -- cancellation ---------------------------------------------------------------------------

    async def _on_cancel(self, msg: Msg) -> None:
        cancel = decode(CancelRequest, msg.data)
        state = self.requests.get(cancel.request_id)
        if state is None or state.finished:
            return
        log.info("request %s cancelled: %s", state.request_id, cancel.reason)
        await self._finish(state, "abort")

    # -- the per-worker loop --------------------------------------------------------------------

    async def _worker_loop(self, worker: Worker) -> None:
        epoch = worker.epoch
        while True:
            worker.wake.clear()
            if worker.epoch != epoch or not worker.healthy:
                await self._evacuate(worker)
                if not worker.healthy:
                    return
                epoch = worker.epoch
            passes, admitted = plan_iteration(
                worker.running, worker.waiting, max_batch_tokens=self.settings.max_batch_tokens,
                max_num_seqs=self.settings.max_num_seqs, can_admit=lambda s: self._fits(worker, s),
                rule=self.batching, now=time.monotonic(), prefill_cap=self._prefill_cap(worker))
            if not passes or not self.registry.healthy("ffn"):
                if worker.pending_release and self.registry.healthy("ffn"):
                    await self._publish_release_only(worker)
                await worker.wake.wait()
                continue
            for state in admitted:
                worker.waiting.remove(state)
                worker.running.append(state)
                state.status = Status.RUNNING
            await self._run_iteration(worker, passes)

    def _fits(self, worker: Worker, state: RequestState) -> bool:
        """Admit while the worker's KV (as reported, less other reservations) holds the first chunk.

        With nothing running we always admit: validation guaranteed a lone sequence fits, and
        the worker answers `failed_seq_ids` if our estimate was wrong.
        """
        if not worker.running:
            return True
        own = worker.reserved_blocks.get(state.request_id, 0)
        chunk = min(state.pending_tokens, self.settings.max_batch_tokens)
        return worker.est_free_blocks + own >= worker.blocks_for(chunk)

    def _share(self) -> int:
        """Attention workers per FFN worker (each FFN worker serves about this many)."""
        return max(1, math.ceil(len(self.registry.healthy("attention")) / max(1, len(self.registry.healthy("ffn")))))

    def _prefill_cap(self, worker: Worker) -> PrefillCap | None:
        """aflex: the policy's prefill tokens per iteration of `worker` (None: no cap, the token budget only)."""
        planner = self.aflex
        profile = self.profile_of(worker) if planner is not None else None
        if planner is None or profile is None:
            return None
        share = self._share()

        def cap(queued: int, n_decode: int, decode_ctx: float, head: int) -> int:
            assert planner is not None and profile is not None
            return planner.prefill_tokens(profile, queued, n_decode, decode_ctx, head, share)
        return cap

    def _depth(self, worker: Worker, passes: list[Pass]) -> int:
        """Microbatch depth: the aflex plan's for this phase when "auto" (and planned), else batcher.py's rule."""
        if self.settings.microbatch_depth == "auto" and self.aflex is not None:
            phase: ClockPhase = "decode" if phase_of(passes) == "decode" else "prefill"
            plan = self.plans.get(worker.worker_id, {}).get(phase)
            if plan is not None:
                return max(1, min(plan.op.depth, len(passes)))
        return microbatch_depth(self.settings.microbatch_depth, len(passes))

    async def _run_iteration(self, worker: Worker, passes: list[Pass]) -> None:
        worker.iteration += 1
        groups = split_microbatches(passes, self._depth(worker, passes))
        if self.aflex is not None:
            window = self.samples.setdefault(worker.worker_id, deque())
            window.append(_sample(passes, time.monotonic(), len(groups)))
            while window and window[-1].mono - window[0].mono > self.settings.freq_window_s:
                window.popleft()
        sent: list[tuple[str, list[Pass], asyncio.Future[MicrobatchDone]]] = []
        ffn_of: dict[str, str] = {}
        loop = asyncio.get_running_loop()
        for k, group in enumerate(groups):
            ffn = self.registry.next_ffn()
            assert ffn is not None  # checked by the caller, nothing awaited since
            mb_id = f"{self._run_token}-{worker.worker_id}-{worker.iteration}-{k}"
            desc = MicrobatchDescriptor(mb_id=mb_id, iteration=worker.iteration, phase=phase_of(group),
                                        ffn_worker=ffn.worker_id, seqs=[p.seq_work() for p in group],
                                        release=worker.pending_release)
            worker.pending_release = []
            for p in group:
                p.state.in_flight = True
                p.state.first_pass_sent = True
            fut: asyncio.Future[MicrobatchDone] = loop.create_future()
            self.futures[mb_id] = InFlight(worker.worker_id, fut, time.monotonic())
            ffn_of[mb_id] = ffn.worker_id
            sent.append((mb_id, group, fut))
            await self.nc.publish(subjects.attn_mb(worker.worker_id), encode(desc))
        await asyncio.wait([f for _, _, f in sent], timeout=self.settings.microbatch_timeout_s)
        for mb_id, group, fut in sent:
            self.futures.pop(mb_id, None)
            if fut.done() and fut.exception() is None:
                self._observe(worker, group, fut.result(), ffn_of[mb_id], lone=len(sent) == 1)
                await self._apply(worker, group, fut.result())
                continue
            reason = str(fut.exception()) if fut.done() else f"no MicrobatchDone for {mb_id} within " \
                f"{self.settings.microbatch_timeout_s:.1f} s"
            bus_lost = fut.done() and isinstance(fut.exception(), BusLostError)  # not the sequences' fault
            if not fut.done():
                fut.cancel()
            log.warning("microbatch %s failed: %s", mb_id, reason)
            for p in group:
                await self._requeue(worker, p.state, failure=not bus_lost, reason=reason)

    async def _on_done(self, msg: Msg) -> None:
        done = decode(MicrobatchDone, msg.data)
        worker = self.registry.workers.get(done.worker_id)
        if worker is not None:
            worker.last_seen = time.monotonic()  # a done is as good as a heartbeat
            worker.kv_free_blocks, worker.kv_total_blocks = done.kv_free_blocks, done.kv_total_blocks
        entry = self.futures.get(done.mb_id)
        if entry is not None and not entry.done.done():
            entry.done.set_result(done)

    async def _apply(self, worker: Worker, group: list[Pass], done: MicrobatchDone) -> None:
        energy = getattr(done, "energy_j", None)
        if energy is not None:
            share_energy(group, float(energy), set(done.failed_seq_ids))
        failed = set(done.failed_seq_ids)
        if done.error is not None and not failed:
            failed = {p.state.request_id for p in group}
        tokens = {r.seq_id: r.token_id for r in done.results}
        for p in group:
            state = p.state
            state.in_flight = False
            worker.reserved_blocks.pop(state.request_id, None)  # the worker's report now counts it
            if state.finished or state.worker_id != worker.worker_id:
                continue  # cancelled, or moved elsewhere, while in flight
            if state.request_id in failed:
                reason = done.error.message if done.error else "the worker refused it (KV cache exhausted)"
                await self._requeue(worker, state, failure=done.error is not None, reason=reason)
                continue
            state.num_computed += p.n_new
            if not p.samples:
                continue
            token = tokens.get(state.request_id)
            if token is None:
                await self._requeue(worker, state, failure=True, reason="the worker sampled no token")
                continue
            await self._append(state, token)

    async def _requeue(self, worker: Worker, state: RequestState, *, failure: bool, reason: str) -> None:
        """Take `state` off `worker` and route it again for recomputation (or fail it for good)."""
        if state.finished or state.worker_id != worker.worker_id:
            return  # cancelled, or already moved elsewhere
        self._detach(worker, state)
        if state.num_computed or state.first_pass_sent:
            worker.pending_release.append(state.request_id)
        state.reset_for_recompute()
        if failure:
            state.failures += 1
            if state.failures >= MAX_FAILURES:
                await self._finish(state, "error", ErrorBody(
                    type="server_error", message=f"request failed {state.failures} times; last: {reason}",
                    code="500"))
                return
        else:
            state.preemptions += 1
        self._route(state, front=True)

    async def _evacuate(self, worker: Worker) -> None:
        """The worker was lost or restarted: everything it held is recomputed elsewhere (or there again)."""
        states = [*worker.running, *worker.waiting]
        worker.reserved_blocks.clear()
        for state in states:
            if state.worker_id == worker.worker_id and not state.finished:
                await self._requeue(worker, state, failure=False, reason=f"worker {worker.worker_id} lost")
        if not worker.healthy:
            worker.pending_release.clear()  # sent if it comes back without restarting: see _lose
            worker.pending_release.extend(s.request_id for s in states)

    def _detach(self, worker: Worker, state: RequestState) -> None:
        if state in worker.running:
            worker.running.remove(state)
        if state in worker.waiting:
            worker.waiting.remove(state)
        if state in self.unplaced:
            self.unplaced.remove(state)
        worker.reserved_blocks.pop(state.request_id, None)

    async def _publish_release_only(self, worker: Worker) -> None:
        """Free KV of finished/cancelled sequences now, without waiting for more work.

        No `MicrobatchDone` is awaited for it; if the worker sends one, it only updates KV counts.
        """
        ffn = self.registry.healthy("ffn")[0]
        worker.iteration += 1
        desc = MicrobatchDescriptor(mb_id=f"{self._run_token}-{worker.worker_id}-{worker.iteration}-r",
                                    iteration=worker.iteration, phase="decode", ffn_worker=ffn.worker_id,
                                    seqs=[], release=worker.pending_release)
        worker.pending_release = []
        await self.nc.publish(subjects.attn_mb(worker.worker_id), encode(desc))

    # -- streaming ------------------------------------------------------------------------------

    async def _append(self, state: RequestState, token: int) -> None:
        reason = state.finish_reason_after(token, self.model.eos_token_ids)
        state.output_ids.append(token)
        now = time.time()
        state.last_token_ts = now
        if state.first_token_ts is None:
            state.first_token_ts = now
            ttft = state.ttft_s
            assert ttft is not None
            self.ttft_log.append((time.monotonic(), ttft * 1000.0))
        if reason is not None:
            await self._finish(state, reason, last_tokens=[token])
            return
        await self._publish(state, OutputDelta(request_id=state.request_id, index=state.next_index,
                                               token_ids=[token]))

    async def _finish(self, state: RequestState, reason: FinishReason, error: ErrorBody | None = None,
                      last_tokens: list[int] | None = None) -> None:
        """End a request: free its place (KV released with the worker's next descriptor), send the final delta."""
        state.status = Status.FINISHED
        state.finish_reason = reason
        self.requests.pop(state.request_id, None)
        if state in self.unplaced:
            self.unplaced.remove(state)
        worker = self.registry.workers.get(state.worker_id or "")
        if worker is not None:
            had_kv = state in worker.running or state.first_pass_sent
            self._detach(worker, state)
            if had_kv:
                worker.pending_release.append(state.request_id)
                worker.wake.set()
        self._record_finished(state, reason)
        usage = Usage(prompt_tokens=len(state.prompt_ids), completion_tokens=len(state.output_ids),
                      total_tokens=state.num_tokens, energy_j=state.energy_j)
        await self._publish(state, OutputDelta(request_id=state.request_id, index=state.next_index,
                                               token_ids=last_tokens or [], finish_reason=reason, usage=usage,
                                               error=error))

    async def _publish(self, state: RequestState, delta: OutputDelta) -> None:
        state.next_index += 1
        await self.nc.publish(subjects.req_out(state.request_id), encode(delta))

    # -- SLO observation, frequency commands, telemetry -----------------------------------------

    @property
    def _stats_window_s(self) -> float:
        """SLO attainment and p90s cover requests finished within this many seconds."""
        hz = self.settings.telemetry_hz
        return max(self.settings.freq_window_s, 1.0 / hz if hz > 0 else 0.0)

    def _record_finished(self, state: RequestState, reason: FinishReason) -> None:
        self.finished_total += 1
        ttft, tpot = state.ttft_s, state.tpot_s
        self.finished_log.append(Finished(time.monotonic(), reason, None if ttft is None else ttft * 1000.0,
                                          None if tpot is None else tpot * 1000.0))

    def _prune(self, now: float) -> None:
        keep = self._stats_window_s
        while self.finished_log and now - self.finished_log[0].mono > keep:
            self.finished_log.popleft()
        while self.ttft_log and now - self.ttft_log[0][0] > keep:
            self.ttft_log.popleft()

    def _signals(self, now: float) -> dict[ClockPhase, PhaseSignal]:
        """TTFT (prefill) and TPOT (decode) seen in the last frequency window, for the clock planner.

        TTFT: every first token of the window; a request still waiting for its first token longer
        than the SLO counts as a miss. TPOT: requests finished in the window, and running ones that
        streamed in it (their TPOT so far), so long requests steer the clocks before they end.
        """
        self._prune(now)
        window = self.settings.freq_window_s
        ttft_slo, tpot_slo = self.settings.ttft_slo_ms, self.settings.tpot_slo_ms
        ttfts = [ms for t, ms in self.ttft_log if now - t <= window]
        tpots = [f.tpot_ms for f in self.finished_log if now - f.mono <= window and f.tpot_ms is not None]
        ttft_miss = sum(ms > ttft_slo for ms in ttfts)
        unix = time.time()
        for state in self.requests.values():
            if state.first_token_ts is None:
                ttft_miss += (unix - state.arrival_ts) * 1000.0 > ttft_slo
            elif state.last_token_ts is not None and unix - state.last_token_ts <= window:
                tpot = state.tpot_s
                if tpot is not None:
                    tpots.append(tpot * 1000.0)
        tpot_miss = sum(ms > tpot_slo for ms in tpots)
        ttft_count = len(ttfts) + ttft_miss - sum(ms > ttft_slo for ms in ttfts)  # late waiters count too
        return {"prefill": PhaseSignal(percentile(ttfts, 90), ttft_slo, ttft_miss, ttft_count),
                "decode": PhaseSignal(percentile(tpots, 90), tpot_slo, tpot_miss, len(tpots))}

    async def _freq_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.freq_window_s)
            await self.freq_window()

    async def freq_window(self) -> None:
        """One frequency window: plan and command every healthy worker with supported clocks."""
        signals = self._signals(time.monotonic())
        planned: dict[str, tuple[dict[ClockPhase, int], str]] = {}
        if self.aflex is not None:
            self.aflex.update_margins({p: (sig.p90_ms, sig.misses, sig.count) for p, sig in signals.items()})
            planned = self._aflex_window()
        for worker in sorted(self.registry.workers.values(), key=lambda w: w.worker_id):
            if worker.healthy and worker.supported_clocks_mhz:
                await self._command(worker, signals, planned.get(worker.worker_id))

    # -- the aflex clock policy ------------------------------------------------------------------

    def profile_of(self, worker: Worker) -> GPUProfile | None:
        """The worker's GPU profile: as registered, or guessed from its GPU name; None when unknown."""
        key = (worker.gpu_profile, worker.gpu_name)
        if key not in self._profiles:
            name = guess_profile(worker.gpu_profile, worker.gpu_name, available_profiles())
            try:
                self._profiles[key] = load_profile(name) if name else None
            except GPUError:
                self._profiles[key] = None
        return self._profiles[key]

    def _aflex_window(self) -> dict[str, tuple[dict[ClockPhase, int], str]]:
        """Clocks for every worker aflex can plan: each attention worker from its own pair plan, each FFN
        worker at the highest FFN clock any pair asks for; a phase nothing ran in holds its clock."""
        assert self.aflex is not None
        attention = self.registry.healthy("attention")
        ffn = self.registry.healthy("ffn")
        share = self._share()
        now_mono, now_unix = time.monotonic(), time.time()
        fresh: dict[str, dict[ClockPhase, PairPlan]] = {}
        for w in attention:
            window = self.samples.get(w.worker_id, deque())
            while window and now_mono - window[0].mono > self.settings.freq_window_s:
                window.popleft()
            profile = self.profile_of(w)
            if profile is None or not window:
                continue
            waiting = list(w.waiting)
            order = serving_order(now_mono, [(s.received_mono, float(s.pending_tokens)) for s in waiting],
                                  self.aflex.batching)
            queue = [(waiting[k].arrival_ts, float(waiting[k].pending_tokens)) for k in order]
            previous = self.plans.setdefault(w.worker_id, {})
            for phase in PHASES:
                prev = previous.get(phase)
                plan = self.aflex.plan_pair(profile, phase, list(window), share, now_unix,
                                            queue if phase == "prefill" else (), prev.op if prev else None)
                if plan is not None:
                    previous[phase] = plan
                    fresh.setdefault(w.worker_id, {})[phase] = plan
        out: dict[str, tuple[dict[ClockPhase, int], str]] = {}
        for w in [*attention, *ffn]:
            if not w.supported_clocks_mhz or self.profile_of(w) is None:
                continue
            table, before = w.supported_clocks_mhz, self.commanded.get(w.worker_id, {})
            clocks: dict[ClockPhase, int] = {}
            why = []
            for phase in PHASES:
                if w.role == "attention":
                    plans = [fresh[w.worker_id][phase]] if phase in fresh.get(w.worker_id, {}) else []
                    want = [p.op.clock_attention for p in plans]
                else:
                    plans = [p[phase] for p in fresh.values() if phase in p]
                    want = [p.op.clock_ffn for p in plans]
                if want:
                    clocks[phase] = snap_up(table, max(want))
                    top = max(plans, key=lambda p: p.op.clock_ffn if w.role == "ffn" else p.op.clock_attention)
                    op = top.op
                    why.append(f"{phase} {top.stats.n_tokens:.0f} tok/{top.stats.ctx_tokens:.0f} ctx, budget "
                               f"{top.budget_s * 1e3:.1f} ms, depth {op.depth}: A {op.clock_attention:.0f} / "
                               f"F {op.clock_ffn:.0f} MHz{'' if op.feasible else ' (infeasible: fastest)'}")
                else:
                    clocks[phase] = before.get(phase, table[-1])
                    why.append(f"{phase} idle: hold")
            margins = self.aflex.margins
            out[w.worker_id] = (clocks, f"aflex (margins {margins['prefill'].margin:.2f}/"
                                        f"{margins['decode'].margin:.2f}): " + "; ".join(why))
        return out

    def _observe(self, worker: Worker, group: list[Pass], done: MicrobatchDone, ffn_id: str, *, lone: bool) -> None:
        """Correct the aflex predictors from one microbatch's timings at the clocks commanded for it."""
        if self.aflex is None or not self.settings.freq_observe or done.error is not None or not group:
            return
        if done.attention_s <= 0 and done.ffn_wait_s <= 0 and done.ffn_compute_s <= 0:
            return
        profile = self.profile_of(worker)
        if profile is None:
            return
        sample = _sample(group, time.monotonic())
        phase = sample.phase
        self.aflex.observe(profile, phase, sample, attention_s=done.attention_s, ffn_wait_s=done.ffn_wait_s,
                           clock_attention=self.commanded.get(worker.worker_id, {}).get(phase),
                           clock_ffn=self.commanded.get(ffn_id, {}).get(phase), lone=lone,
                           ffn_compute_s=done.ffn_compute_s)

    async def _command(self, worker: Worker, signals: dict[ClockPhase, PhaseSignal],
                       planned: tuple[dict[ClockPhase, int], str] | None = None) -> None:
        policy = self.settings.freq_policy
        previous = self.commanded.get(worker.worker_id)
        if planned is not None:
            clocks, reason = planned
        elif policy == "aflex" and self.aflex is not None and self.profile_of(worker) is not None:
            top = worker.supported_clocks_mhz[-1]
            clocks = dict(previous) if previous else {p: top for p in PHASES}
            reason = "aflex: hold" if previous else "aflex: start at max"
        else:
            fallback = policy == "aflex"
            if fallback and worker.worker_id not in self._warned:
                self._warned.add(worker.worker_id)
                why = "the model's shape is unknown" if self.aflex is None else \
                    f"GPU profile unknown (profile {worker.gpu_profile!r}, name {worker.gpu_name!r})"
                log.warning("clock policy aflex: worker %s falls back to slo: %s", worker.worker_id, why)
            clocks, reason = plan_clocks("slo" if fallback else policy, worker.role, worker.supported_clocks_mhz,
                                         previous=previous, signals=signals, fixed=self.fixed_clocks)
            if fallback:
                reason += " (aflex fallback)"
        self.commanded[worker.worker_id] = clocks
        now = time.time()
        cmd = FrequencyCommand(worker_id=worker.worker_id, clocks_mhz=clocks, issued_ts=now,
                               valid_until_ts=now + 3 * self.settings.freq_window_s, reason=reason)
        await self.nc.publish(subjects.freq(worker.worker_id), encode(cmd))

    def telemetry(self) -> SchedulerTelemetry:
        now = time.monotonic()
        self._prune(now)
        ttft_slo, tpot_slo = self.settings.ttft_slo_ms, self.settings.tpot_slo_ms
        done = [f for f in self.finished_log if f.reason != "abort"]  # a client's cancel is no miss
        good = sum(f.reason != "error" and f.ttft_ms is not None and f.ttft_ms <= ttft_slo
                   and (f.tpot_ms or 0.0) <= tpot_slo for f in done)
        ttfts = [f.ttft_ms for f in done if f.ttft_ms is not None]
        tpots = [f.tpot_ms for f in done if f.tpot_ms is not None]
        clocks = {wid: {str(p): mhz for p, mhz in c.items()} for wid, c in self.commanded.items()
                  if (w := self.registry.workers.get(wid)) is not None and w.healthy}
        return SchedulerTelemetry(
            scheduler_id=self.settings.scheduler_id, ts=time.time(), queue_depth=self.queue_depth,
            running=sum(len(w.running) for w in self.registry.workers.values()), finished=self.finished_total,
            slo_attainment=good / len(done) if done else None, ttft_p90_ms=percentile(ttfts, 90),
            tpot_p90_ms=percentile(tpots, 90), clocks_mhz=clocks)

    async def _telemetry_loop(self) -> None:
        subject = subjects.telemetry("scheduler", self.settings.scheduler_id)
        while True:
            await asyncio.sleep(1.0 / self.settings.telemetry_hz)
            await self.nc.publish(subject, encode(self.telemetry()))


def _sample(passes: list[Pass], mono: float, depth: int = 1) -> IterationSample:
    return sample_of(((p.n_new, p.start, p.samples, p.is_decode, len(p.state.prompt_ids)) for p in passes),
                     mono, depth)


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


async def run(settings: SchedulerSettings, *, stop: asyncio.Event | None = None,
              model: ModelInfo | None = None) -> None:
    """Run the scheduler until `stop` is set (or forever). `model` overrides reading the model card."""
    if model is None:
        model = await asyncio.to_thread(load_model_info, settings.model)
    scheduler: Scheduler | None = None

    def bus_lost() -> None:
        if scheduler is not None:
            scheduler.on_bus_lost()

    nc = await bus.connect(settings.nats_url, f"scheduler {settings.scheduler_id}", on_disconnect=bus_lost)
    scheduler = Scheduler(settings, nc, model)
    try:
        await scheduler.start()
        log.info("scheduler %s serving %s on %s", settings.scheduler_id, model.model_id, settings.nats_url)
        await (stop or asyncio.Event()).wait()
    finally:
        await scheduler.stop()
        await bus.close(nc)

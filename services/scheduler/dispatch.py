"""Dispatch: the per-worker iteration loops, the verdicts applied, the tokens streamed, the requests ended.

One asyncio task per attention worker runs iterations: plan (`shared.policy.plan_iteration` through
passes.py, with the batching policy's iteration policy), publish the microbatch descriptors, wait for every
`MicrobatchDone`, apply recovery.py's verdicts (a result stands and streams; a failed pass is taken
back and routed again, or the request fails after MAX_FAILURES), stream `OutputDelta`s. `finish` is
the one place a request ends. Everything runs on the scheduler's one event loop, so request state
needs no locks; NATS callbacks only mutate state and set events, the loops do the waiting. A
microbatch's energy is shared among its sequences by the tokens each fed.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.client import Client
from nats.aio.msg import Msg

from services.scheduler import forks, recovery
from services.scheduler.batching import BatchingPolicy
from services.scheduler.governor import Governor
from services.scheduler.handoff import Handoffs
from services.scheduler.model_info import ModelInfo
from services.scheduler.outputs import OutputStream, token_delta
from services.scheduler.passes import Pass, PassPlan, plan_passes, release_only, share_energy
from services.scheduler.plan_loop import ProvisioningLoop
from services.scheduler.prefix_index import PrefixIndex
from services.scheduler.recovery import InFlight
from services.scheduler.registry import Registry, Worker
from services.scheduler.routing import Placement
from services.scheduler.slo_watch import SloWatch
from services.scheduler.state import RequestState, Status
from services.scheduler.tasks import TaskSet
from shared import subjects
from shared.error_types import PREFIX_MISSING
from shared.kinds import runs_own_ffn
from shared.messages import (
    ErrorBody,
    FinishReason,
    MicrobatchDescriptor,
    MicrobatchDone,
    OutputDelta,
    TokenLogprob,
    Usage,
    decode,
    encode,
)
from shared.settings import SchedulerSettings

log = logging.getLogger("aflex.scheduler")


class Dispatch:
    """Owns the microbatches in flight, the KV handoffs and the output streams; the scheduler owns the rest."""

    def __init__(self, settings: SchedulerSettings, nc: Client, model: ModelInfo, registry: Registry,
                 requests: dict[str, RequestState], placement: Placement, prefixes: PrefixIndex | None,
                 governor: Governor, batching: BatchingPolicy, slo: SloWatch, provisioning: ProvisioningLoop | None,
                 tasks: TaskSet, run_token: str) -> None:
        self.settings, self.nc, self.model, self.registry = settings, nc, model, registry
        self.requests, self.placement, self.prefixes = requests, placement, prefixes
        self.governor, self.batching, self.slo = governor, batching, slo
        self.provisioning, self.tasks, self.run_token = provisioning, tasks, run_token
        self.in_flight = InFlight()
        self.outputs = OutputStream(nc)
        self.handoffs = Handoffs(nc, registry, run_token, settings.kv_handoff_timeout_s, tasks.spawn)

    # -- the per-worker loop --------------------------------------------------------------------

    def start_lane(self, worker: Worker) -> None:
        """Run `worker`'s iteration loop (it ends when the worker is lost; membership says when to start it again)."""
        worker.lane.task = self.tasks.spawn(self._worker_loop(worker))

    async def _worker_loop(self, worker: Worker) -> None:
        lane = worker.lane
        epoch = lane.epoch
        while True:
            lane.wake.clear()
            if lane.epoch != epoch or not worker.healthy:
                for state in recovery.evacuate(worker):
                    self.placement.route(state, front=True)
                if not worker.healthy:
                    return
                epoch = lane.epoch
            now = time.monotonic()
            policy = self.batching.iteration_policy(worker, now, self.governor.planned_depth(worker.worker_id))
            plan = plan_passes(lane.running, lane.waiting, policy, lane.kv_room())
            if not plan.groups or not self.registry.has_ffn(worker):
                if lane.pending_release and self.registry.has_ffn(worker):
                    await self._publish_release_only(worker)
                await lane.wake.wait()
                continue
            lane.admit(plan.admitted)
            if await self._run_iteration(worker, plan):  # a failed one says nothing of a step's cost
                self.batching.iteration_done(worker, plan.passes, time.monotonic() - now)

    async def _run_iteration(self, worker: Worker, plan: PassPlan) -> bool:
        """Run one iteration; True when every microbatch came back whole (no error, nothing refused)."""
        lane = worker.lane
        iteration = lane.next_iteration()
        self.governor.iteration_sent(worker, plan.passes, len(plan.groups), time.monotonic())
        sent: list[tuple[str, list[Pass], asyncio.Future[MicrobatchDone], str]] = []  # (id, group, Done, FFN worker)
        for k, group in enumerate(plan.groups):
            ffn = self.registry.ffn_for(worker)
            assert ffn is not None  # checked by the caller, nothing awaited since
            mb_id = f"{self.run_token}-{worker.worker_id}-{iteration}-{k}"
            release = lane.take_releases(keep=forks.forked_later([p.state for p in g] for g in plan.groups[k + 1:]))
            desc = MicrobatchDescriptor(mb_id=mb_id, iteration=iteration, phase=plan.phases[k],
                                        ffn_worker=ffn.worker_id, seqs=[p.seq_work() for p in group],
                                        release=release)
            for p in group:
                p.state.in_flight = True
                p.state.first_pass_sent = True
            fut = self.in_flight.track(mb_id, worker.worker_id, time.monotonic(), ffn.worker_id)
            sent.append((mb_id, group, fut, ffn.worker_id))
            await self.nc.publish(subjects.attn_mb(worker.worker_id), encode(desc))
        timeout_s = self.settings.microbatch_timeout_s
        await asyncio.wait([f for _, _, f, _ in sent], timeout=timeout_s)
        whole = True
        for mb_id, group, fut, ffn_id in sent:
            self.in_flight.forget(mb_id)
            outcome = (fut.exception() or fut.result()) if fut.done() else None
            if not fut.done():
                fut.cancel()
            judgement = recovery.judge(outcome, [p.state.request_id for p in group], [p.samples for p in group],
                                       ffn_id, timeout_s, mb_id)
            whole = whole and judgement.whole
            if judgement.unreachable_ffn is not None:
                self.registry.suspect(judgement.unreachable_ffn, judgement.why)
            if isinstance(outcome, MicrobatchDone):
                self.governor.microbatch_done(worker, group, outcome, ffn_id, lone=len(sent) == 1)
                if outcome.energy_j is not None:
                    share_energy(group, outcome.energy_j, set(outcome.failed_seq_ids))
            else:
                log.warning("microbatch %s failed: %s", mb_id, judgement.verdicts[0].reason if group else outcome)
            await self._apply(worker, group, judgement.verdicts, returned=isinstance(outcome, MicrobatchDone))
        return whole

    async def on_done(self, msg: Msg) -> None:
        done = decode(MicrobatchDone, msg.data)
        worker = self.registry.workers.get(done.worker_id)
        if worker is not None:
            worker.last_seen = time.monotonic()  # a done is as good as a heartbeat
            worker.report_kv(done.kv_free_blocks, done.kv_total_blocks)
        self.in_flight.settle(done)

    async def _apply(self, worker: Worker, group: list[Pass], verdicts: list[recovery.Verdict], *,
                     returned: bool) -> None:
        """Apply recovery's verdicts: a result stands and streams, a failed pass is taken back and routed again."""
        for p, verdict in zip(group, verdicts, strict=True):
            state = p.state
            if returned:  # (a microbatch that never came back leaves its reservations to take_back)
                state.in_flight = False
                worker.lane.settled(state)
            if state.finished or state.worker_id != worker.worker_id:
                continue  # cancelled, or moved elsewhere, while in flight
            if not verdict.ok:
                if verdict.code == PREFIX_MISSING and self.prefixes is not None:
                    self.prefixes.missing(worker.worker_id, state.prefix_names or [])
                if verdict.code is not None and not verdict.blamed:
                    log.info("request %s sent again (%s): %s", state.request_id, verdict.code, verdict.reason)
                await self._requeue(worker, state, failure=verdict.blamed, reason=verdict.reason)
                continue
            state.num_computed += p.n_new
            if self.prefixes is not None:
                self.prefixes.computed(worker.worker_id, state, worker.block_size, worker.kv_total_blocks)
            self.placement.prompt_in(state)
            result = verdict.result
            if result is not None and result.prompt_logprobs:
                state.note_prompt_logprobs(result.prompt_logprobs_start, result.prompt_logprobs)
            if p.samples:
                assert result is not None and result.token_id is not None  # judged so
                await self._append(state, result.token_id, result.logprob)
                if self.handoffs.wanted(worker, state):  # a P/D plan's prefill worker: on to a decode worker
                    self.handoffs.start(worker, state)

    async def _requeue(self, worker: Worker, state: RequestState, *, failure: bool, reason: str) -> None:
        """Take `state` off `worker` and route it again for recomputation (or fail it for good)."""
        if state.finished or state.worker_id != worker.worker_id:
            return  # cancelled, or already moved elsewhere
        error = recovery.take_back(worker, state, failure=failure, reason=reason)
        if error is not None:
            await self.finish(state, "error", error)
        else:
            self.placement.route(state, front=True)

    async def _publish_release_only(self, worker: Worker) -> None:
        """Free KV of finished/cancelled sequences now, without waiting for more work.

        No `MicrobatchDone` is awaited for it; if the worker sends one, it only updates KV counts.
        """
        ffn = worker if runs_own_ffn(worker.assignment) else self.registry.healthy("ffn")[0]
        desc = release_only(worker, ffn.worker_id, self.run_token)
        self.in_flight.note_sent(desc.mb_id, worker.worker_id)
        await self.nc.publish(subjects.attn_mb(worker.worker_id), encode(desc))

    # -- streaming ------------------------------------------------------------------------------

    async def _append(self, state: RequestState, token: int, logprob: TokenLogprob | None = None) -> None:
        reason = state.finish_reason_after(token, self.model.eos_token_ids)
        state.output_ids.append(token)
        state.logprobs.append(logprob)
        now = time.time()
        state.last_token_ts = now
        if state.first_token_ts is None:
            state.first_token_ts = now
            ttft = state.ttft_s
            assert ttft is not None
            self.slo.first_token(time.monotonic(), ttft * 1000.0)
            if self.provisioning is not None:
                self.provisioning.first_token(time.monotonic(), ttft * 1000.0)
        if reason is not None:
            await self.finish(state, reason, last_token=True)
            return
        await self.outputs.token(state)

    async def finish(self, state: RequestState, reason: FinishReason, error: ErrorBody | None = None,
                      last_token: bool = False, retry_after_s: float | None = None) -> None:
        """End a request: free its place (KV released with the worker's next descriptor), send the final delta."""
        state.status = Status.FINISHED
        state.finish_reason = reason
        self.requests.pop(state.request_id, None)
        self.placement.finished(state)
        worker = self.registry.workers.get(state.worker_id or "")
        if worker is not None and worker.attention_lane is not None:
            lane = worker.attention_lane
            lane.release(state, holds_kv=state in lane.running or state.first_pass_sent)
        self.slo.finished(state, reason, time.monotonic())
        if self.provisioning is not None:
            self.provisioning.finished(state)
        usage = Usage(prompt_tokens=len(state.prompt_ids), completion_tokens=len(state.output_ids),
                      total_tokens=state.num_tokens, energy_j=state.energy_j, cached_tokens=state.cached_tokens)
        delta = (token_delta(state, state.next_index, finish_reason=reason, usage=usage, error=error) if last_token
                 else OutputDelta(request_id=state.request_id, index=state.next_index, token_ids=[],
                                  finish_reason=reason, usage=usage, error=error, retry_after_s=retry_after_s))
        await self.outputs.final(state, delta)

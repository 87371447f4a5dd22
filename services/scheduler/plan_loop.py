"""The global scheduler's loop in the live mesh: every provisioning window, plan, assign, publish.

fleet_plan.py decides (the simulator's planning call over the live workers); this module feeds it
what dispatch admitted and finished, applies its answer to the registry, and publishes it: a
`RoleAssignment` to every worker on `control.role.<wid>`, the plan as `PlanTelemetry` on
`telemetry.plan`. Dispatch is told which workers changed (`on_change`), so it re-routes the requests
that had not started on a worker now parked, starts the loops of woken ones, and sends new clocks at
once: a parked worker idles at its lowest clock once it has drained (warm parking; governor.py).
A serving worker lost between windows brings the next plan forward, so parked workers wake at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from nats.aio.client import Client

from services.scheduler.fleet_plan import PlanDecision, Provisioner
from services.scheduler.governor import Governor
from services.scheduler.profiles import Profiles
from services.scheduler.registry import Registry, Worker
from services.scheduler.state import RequestState
from shared import subjects
from shared.kinds import PARKED
from shared.messages import PlanTelemetry, RoleAssignment, WeighedKind, encode
from shared.perf import cached_predictor
from shared.policy import SHARED_CLOCK_OBJECTIVE, ClockRule
from shared.settings import SchedulerSettings

log = logging.getLogger("aflex.scheduler")


class ProvisioningLoop:
    def __init__(self, settings: SchedulerSettings, nc: Client, registry: Registry, governor: Governor,
                 profiles: Profiles, on_change: Callable[[list[Worker]], None]) -> None:
        s = settings
        self.settings, self.nc, self.registry, self.governor, self.on_change = s, nc, registry, governor, on_change
        self.profiles = profiles
        self.provisioner = Provisioner(window_s=s.provision_window_s, ttft_slo_ms=s.ttft_slo_ms,
                                       tpot_slo_ms=s.tpot_slo_ms, link_bytes_s=s.freq_link_gbs * 1e9,
                                       headroom=s.provision_headroom, min_attention=s.provision_min_attention,
                                       min_ffn=s.provision_min_ffn, parking=s.provision_parking)
        self.args = governor.planner.args if governor.planner is not None else None
        self._warned = False
        self._replan = asyncio.Event()

    @property
    def plan_id(self) -> int:
        return self.provisioner.plan_id

    def admitted(self, state: RequestState) -> None:
        self.provisioner.loads.admitted(state.request_id, time.monotonic(), len(state.prompt_ids),
                                        state.sampling.max_tokens)

    def first_token(self, mono: float, ttft_ms: float) -> None:
        self.provisioner.first_token(mono, ttft_ms)

    def finished(self, state: RequestState) -> None:
        self.provisioner.loads.finished(state.request_id, len(state.output_ids))
        if (tpot_s := state.tpot_s) is not None:
            self.provisioner.finished_tpot(time.monotonic(), state.received_mono, tpot_s)

    def lost(self, worker: Worker) -> None:
        """A worker went silent: it holds no assignment now; if it served, plan again without waiting."""
        self.provisioner.forget(worker.worker_id)
        if not worker.parked:
            self._replan.set()
        worker.assignment = None

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._replan.wait(), self.settings.provision_window_s)
            self._replan.clear()
            try:
                await self.window()
            except Exception:  # a plan that fails leaves the assignments as they are; the next window tries again
                log.exception("provisioning: the plan failed; assignments unchanged")

    async def window(self) -> PlanDecision | None:
        """One provisioning window: the plan over the healthy registered workers, applied and published."""
        attention, ffn = self.registry.attention_workers(), self.registry.healthy("ffn")
        kinds = self.kinds(attention, ffn)
        if not attention or not (ffn or "pd-colocated" in kinds):
            return None  # no FFN worker: whole-model workers, each `colocated` as it registered, unless P/D pools
        profile = self.profiles.of(attention[0])
        if self.args is None or profile is None:
            if not self._warned:
                self._warned = True
                log.warning("provisioning aflex: %s; every worker serves", "the model's shape is unknown"
                            if self.args is None else f"the GPU profile of {attention[0].worker_id} is unknown")
            return None
        planner = self.governor.planner
        pred = planner.predictor(profile) if planner is not None else cached_predictor(profile, self.args)
        rule = planner.rule if planner is not None else ClockRule(objective=SHARED_CLOCK_OBJECTIVE)
        now = time.monotonic()
        for w in self.registry.workers.values():  # the mesh's energy so far: each plan kind's power correction
            self.provisioner.power.energy.report(w.worker_id, w.gpu_energy_j)
        # the planning call in a thread: the dispatch loop goes on meanwhile (the first builds the predictors)
        decision = await asyncio.to_thread(self.provisioner.plan, now, pred, rule, [w.worker_id for w in attention],
                                           [w.worker_id for w in ffn], kinds,
                                           self.provisioner.observe(now),
                                           [w.worker_id for w in attention if w.can_colocate],
                                           min((m for w in (*attention, *ffn) if (m := w.gpu_memory_bytes) > 0),
                                               default=0.0),
                                           {w.worker_id: w.group_size for w in (*attention, *ffn)})
        changed = [self.registry.workers[w] for w in decision.changed]
        for wid, assignment in decision.assignments.items():
            worker = self.registry.workers[wid]
            if worker.parked and assignment not in PARKED:
                self.governor.worker_woken(wid)
            worker.assignment, worker.pool = assignment, decision.pool_of.get(wid, "")
        if changed:
            log.info("plan %d (%s, %.2f req/s planned): %s", decision.plan_id, decision.plan.kind,
                     decision.load.rate_rps, ", ".join(f"{w.worker_id} -> {w.assignment}" for w in changed))
        self.on_change(changed)
        await self._publish(decision)
        return decision

    def kinds(self, attention: list[Worker], ffn: list[Worker]) -> tuple[str, ...]:
        """The pool kinds this window's plan may use (`provision_kinds`): P/D pools only where the mesh holds
        two of each role and every attention worker has a KV seam to take handed-off sequences; colocated
        replicas only where some attention worker holds both halves, and P/D pools of them where two such
        workers have KV seams; mixed always (the fallback)."""
        pd_fits = len(attention) >= 2 and len(ffn) >= 2 and all(w.kv_address for w in attention)
        whole = any(w.can_colocate for w in attention)  # colocated replicas: on workers holding both halves
        pd_whole = sum(w.can_colocate and bool(w.kv_address) for w in attention) >= 2  # and hand KV between them
        wanted = self.settings.provision_kinds
        if not ffn:  # whole-model workers alone: replicas, or P/D pools of them
            return ("colocated", "pd-colocated") if pd_whole and wanted == "auto" else \
                ("pd-colocated",) if pd_whole and wanted == "pd-colocated" else ("colocated",)
        if wanted == "colocated" and whole:
            return ("colocated",)
        if wanted == "pd" and pd_fits:
            return ("pd",)
        if wanted == "pd-colocated" and pd_whole:
            return ("pd-colocated",)
        if wanted == "auto":
            return ("mixed", *(("pd",) if pd_fits else ()), *(("colocated",) if whole else ()),
                    *(("pd-colocated",) if pd_whole else ()))
        return ("mixed",)

    async def _publish(self, d: PlanDecision) -> None:
        now = time.time()
        reason = f"{d.plan.kind} plan for {d.load.rate_rps:.2f} req/s x {self.provisioner.headroom_rule.headroom:.2f}"
        for wid, assignment in d.assignments.items():
            msg = RoleAssignment(worker_id=wid, assignment=assignment, plan_id=d.plan_id, issued_ts=now,
                                 reason=reason)
            await self.nc.publish(subjects.role(wid), encode(msg))
        pools = {name: ([s.attention, s.ffn, s.attention_tp] if s.split else [s.replicas, s.tp])
                 for name, s in d.plan.pools().items()}
        await self.nc.publish(subjects.TELEMETRY_PLAN, encode(PlanTelemetry(
            scheduler_id=self.settings.scheduler_id, ts=now, plan_id=d.plan_id, kind=d.plan.kind, pools=pools,
            assignments=d.assignments, changed=d.changed, predicted_power_w=d.plan.predicted_power_w,
            feasible=d.plan.feasible, load_rps=d.load.rate_rps, mean_prompt=d.load.mean_prompt,
            mean_output=d.load.mean_output, p90_prompt=d.load.p90_prompt, reason=reason,
            power_factor=d.power_factor or {},
            weighed={kind: WeighedKind(predicted_power_w=p.predicted_power_w, feasible=p.feasible, gpus=p.gpus)
                     for kind, p in d.weighed.items()})))

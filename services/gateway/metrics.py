"""The gateway's Prometheus metrics: `GET /metrics` in the text exposition format (not behind the API key).

Request metrics are measured at the gateway: a pure ASGI middleware counts every response by endpoint
(route template, so ids never become labels) and HTTP status; `Generation` reports each finished
request's TTFT (submission to first token), TPOT ((e2e − TTFT) / (tokens − 1)), e2e latency, token counts
and the energy the workers spent on it (`Usage.energy_j`).

Cluster metrics come from telemetry: the gateway subscribes to `aflex.v1.telemetry.>` and a collector
exports each worker's latest reading at scrape time. A worker silent for `STALE_AFTER_S` drops out of the
export, so a dead worker does not report its last clock and power forever.

Beside the `aflex_*` series, the ones with a vLLM counterpart are exported under vLLM's names too
(`vllm:num_requests_running`, `vllm:time_to_first_token_seconds`, ..., with vLLM's `model_name`
label), so that dashboards made for vLLM work unchanged.

Each app has its own `CollectorRegistry`: several gateways (tests) in one process do not share counts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from nats.aio.client import Client
from nats.aio.msg import Msg
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared import subjects
from shared.messages import PlanTelemetry, ProtocolError, SchedulerTelemetry, WorkerTelemetry, decode

log = logging.getLogger("aflex.gateway")

STALE_AFTER_S = 30.0  # a worker or scheduler silent this long is no longer exported
NOT_COUNTED = frozenset({"/metrics"})  # scrapes do not count as requests

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.12, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class TelemetryCollector(Collector):
    """The latest telemetry of every worker and scheduler, exported as gauges when scraped."""

    def __init__(self, stale_after_s: float = STALE_AFTER_S, model_name: str = "") -> None:
        self.stale_after_s = stale_after_s
        self.model_name = model_name
        self.workers: dict[str, tuple[float, WorkerTelemetry]] = {}  # worker id -> (received, latest)
        self.schedulers: dict[str, tuple[float, SchedulerTelemetry]] = {}
        self.plans: dict[str, tuple[float, PlanTelemetry]] = {}  # the global scheduler's latest, by scheduler

    def update(self, subject: str, data: bytes) -> None:
        """Record one telemetry message; an invalid one is logged and dropped."""
        now = time.monotonic()
        try:
            if subject == subjects.TELEMETRY_PLAN:
                plan = decode(PlanTelemetry, data)
                self.plans[plan.scheduler_id] = (now, plan)
            elif subject.startswith(f"{subjects.PREFIX}.telemetry.scheduler."):
                sched = decode(SchedulerTelemetry, data)
                self.schedulers[sched.scheduler_id] = (now, sched)
            else:
                worker = decode(WorkerTelemetry, data)
                self.workers[worker.worker_id] = (now, worker)
        except ProtocolError as exc:
            log.debug("dropping telemetry on %s: %s", subject, exc)

    def _fresh(self, items: dict[str, tuple[float, Any]]) -> list[Any]:
        cutoff = time.monotonic() - self.stale_after_s
        for key in [k for k, (seen, _) in items.items() if seen < cutoff]:
            del items[key]
        return [msg for _, msg in items.values()]

    def collect(self) -> Iterator[Metric]:
        workers: list[WorkerTelemetry] = sorted(self._fresh(self.workers), key=lambda w: w.worker_id)
        labels = ["worker", "role"]
        clock = GaugeMetricFamily("aflex_gpu_clock_mhz", "Current SM clock of the worker's GPU (MHz)",
                                  labels=labels)
        target = GaugeMetricFamily("aflex_gpu_target_clock_mhz", "SM clock the worker was asked to run (MHz)",
                                   labels=labels)
        power = GaugeMetricFamily("aflex_gpu_power_watts", "Power draw of the worker's GPU (W)", labels=labels)
        energy = GaugeMetricFamily("aflex_gpu_energy_joules",
                                   "Energy the worker's GPU used since the worker started (J, monotonic)",
                                   labels=labels)
        util = GaugeMetricFamily("aflex_worker_utilization", "Busy fraction of the last telemetry period (0..1)",
                                 labels=labels)
        kv_used = GaugeMetricFamily("aflex_kv_blocks_used", "KV-cache blocks in use", labels=["worker"])
        kv_worker = GaugeMetricFamily("aflex_kv_cache_usage_perc", "KV-cache usage of one attention worker. 1 means "
                                      "100 percent usage.", labels=["worker"])
        # the gauge the Gateway API Inference Extension routes on, under vLLM's current and older names
        kv_use = [GaugeMetricFamily(name, "KV-cache usage of the attention workers. 1 means 100 percent usage.",
                                    labels=["model_name"])
                  for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")]
        kv_blocks = [(w.kv_blocks_used, w.kv_blocks_total) for w in workers if w.role == "attention"]
        total_blocks = sum(total for _, total in kv_blocks)
        if total_blocks:
            for family in kv_use:
                family.add_metric([self.model_name], sum(used for used, _ in kv_blocks) / total_blocks)
        for w in workers:
            values = [w.worker_id, w.role]
            clock.add_metric(values, w.clock_mhz)
            if w.target_clock_mhz is not None:
                target.add_metric(values, w.target_clock_mhz)
            power.add_metric(values, w.power_w)
            energy.add_metric(values, w.energy_j)
            util.add_metric(values, w.utilization)
            if w.role == "attention" or w.kv_blocks_total:
                kv_used.add_metric([w.worker_id], w.kv_blocks_used)
            if w.role == "attention" and w.kv_blocks_total:
                kv_worker.add_metric([w.worker_id], w.kv_blocks_used / w.kv_blocks_total)
        yield from (clock, target, power, energy, util, kv_used, kv_worker, *kv_use)

        queue = GaugeMetricFamily("aflex_scheduler_queue_depth", "Requests waiting at the scheduler")
        running = GaugeMetricFamily("aflex_scheduler_running", "Sequences the scheduler is running")
        slo = GaugeMetricFamily("aflex_slo_attainment",
                                "Fraction of recent requests within their TTFT and TPOT SLOs (0..1)")
        vllm_running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution "
                                         "batches.", labels=["model_name"])
        vllm_waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be "
                                         "processed.", labels=["model_name"])
        waiting_worker = GaugeMetricFamily("aflex_num_requests_waiting", "Requests queued on one attention worker "
                                           "(routed there, not yet in a batch)", labels=["worker"])
        running_worker = GaugeMetricFamily("aflex_num_requests_running", "Requests running on one attention "
                                           "worker", labels=["worker"])
        schedulers: list[SchedulerTelemetry] = self._fresh(self.schedulers)
        if schedulers:
            latest = max(schedulers, key=lambda s: s.ts)
            queue.add_metric([], latest.queue_depth)
            running.add_metric([], latest.running)
            vllm_waiting.add_metric([self.model_name], latest.queue_depth)
            vllm_running.add_metric([self.model_name], latest.running)
            for worker_id, waiting in sorted(latest.waiting_by_worker.items()):
                waiting_worker.add_metric([worker_id], waiting)
            for worker_id, running_now in sorted(latest.running_by_worker.items()):
                running_worker.add_metric([worker_id], running_now)
            if latest.slo_attainment is not None:
                slo.add_metric([], latest.slo_attainment)
        yield from (queue, running, slo, vllm_running, vllm_waiting, waiting_worker, running_worker)
        yield from self._plan_metrics()
        yield from self._handoff_metrics(schedulers)

    def _handoff_metrics(self, schedulers: list[SchedulerTelemetry]) -> Iterator[Metric]:
        """P/D KV handoffs (monotonic, the latest scheduler's): made, failed, bytes and seconds."""
        made = CounterMetricFamily("aflex_kv_handoffs", "Sequences moved from a prefill to a decode attention "
                                   "worker with their KV")
        failed = CounterMetricFamily("aflex_kv_handoff_failures", "KV handoffs that failed (the sequence "
                                     "decoded where it was prefilled)")
        nbytes = CounterMetricFamily("aflex_kv_handoff_bytes", "KV bytes moved between attention workers "
                                     "(torch.distributed)")
        seconds = CounterMetricFamily("aflex_kv_handoff_seconds", "Time the KV handoffs took, request to "
                                      "the decode worker's acknowledgement (s)")
        if schedulers:
            latest = max(schedulers, key=lambda s: s.ts)
            made.add_metric([], latest.kv_handoffs)
            failed.add_metric([], latest.kv_handoff_failures)
            nbytes.add_metric([], latest.kv_handoff_bytes)
            seconds.add_metric([], latest.kv_handoff_s)
        yield from (made, failed, nbytes, seconds)

    def _plan_metrics(self) -> Iterator[Metric]:
        """The global scheduler's latest plan: each worker's assignment, and what the plan is for."""
        assignment = GaugeMetricFamily("aflex_worker_assignment", "1 for the global scheduler's assignment of "
                                       "each worker (prefill/decode/mixed-attention, ffn, parked-warm, ...)",
                                       labels=["worker", "assignment"])
        plans = GaugeMetricFamily("aflex_plans", "Plans the global scheduler has made (monotonic)")
        parked = GaugeMetricFamily("aflex_plan_parked_workers", "Workers the latest plan parks")
        load = GaugeMetricFamily("aflex_plan_load_rps", "Arrival rate the latest plan is made for (before headroom)")
        power = GaugeMetricFamily("aflex_plan_predicted_power_watts", "The latest plan's predicted power (W, "
                                  "modelled; absent when no plan meets the SLOs)")
        fresh: list[PlanTelemetry] = self._fresh(self.plans)
        if fresh:
            latest = max(fresh, key=lambda p: p.ts)
            for worker, a in sorted(latest.assignments.items()):
                assignment.add_metric([worker, a], 1)
            plans.add_metric([], latest.plan_id)
            parked.add_metric([], sum(a.startswith("parked") for a in latest.assignments.values()))
            load.add_metric([], latest.load_rps)
            if latest.feasible and latest.predicted_power_w is not None:
                power.add_metric([], latest.predicted_power_w)
        yield from (assignment, plans, parked, load, power)


class GatewayMetrics:
    """Every metric of one gateway, in its own registry."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("aflex_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("aflex_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("aflex_generation_tokens", "Tokens generated for finished requests",
                                         registry=r)
        self.energy = Counter("aflex_request_energy_joules",
                              "Energy the workers spent on finished requests (J, from usage.energy_j)", registry=r)
        self.ttft = Histogram("aflex_time_to_first_token_seconds", "Time to first token, measured at the gateway",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("aflex_time_per_output_token_seconds",
                              "Time per output token after the first, measured at the gateway",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("aflex_e2e_request_latency_seconds", "Request latency, submission to last token",
                             buckets=E2E_BUCKETS, registry=r)
        # the same observations under vLLM's names and label
        m = ["model_name"]
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", m,
                                          registry=r).labels(model_name)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", m,
                                              registry=r).labels(model_name)
        # vLLM's prefix-cache counters, in tokens: prompt tokens looked up, and those the cache held
        self.vllm_prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number "
                                           "of queried tokens.", m, registry=r).labels(model_name)
        self.vllm_prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                        "tokens.", m, registry=r).labels(model_name)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in "
                                   "seconds.", m, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.vllm_tpot = Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in "
                                   "seconds.", m, buckets=TPOT_BUCKETS, registry=r).labels(model_name)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in "
                                  "seconds.", m, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.telemetry = TelemetryCollector(model_name=model_name)
        r.register(self.telemetry)

    # -- requests ---------------------------------------------------------------------------------

    def request_finished(self, *, ttft_s: float | None, e2e_s: float, prompt_tokens: int,
                         completion_tokens: int, energy_j: float | None, cached_tokens: int = 0) -> None:
        """One request that ended with a finish reason (stop, length, stop string)."""
        for tokens in (self.prompt_tokens, self.vllm_prompt_tokens):
            tokens.inc(prompt_tokens)
        self.vllm_prefix_queries.inc(prompt_tokens)
        self.vllm_prefix_hits.inc(cached_tokens)
        for tokens in (self.generation_tokens, self.vllm_generation_tokens):
            tokens.inc(completion_tokens)
        if energy_j is not None and energy_j >= 0:
            self.energy.inc(energy_j)
        for e2e in (self.e2e, self.vllm_e2e):
            e2e.observe(e2e_s)
        if ttft_s is not None:
            for ttft in (self.ttft, self.vllm_ttft):
                ttft.observe(ttft_s)
            if completion_tokens > 1:
                for tpot in (self.tpot, self.vllm_tpot):
                    tpot.observe(max(0.0, e2e_s - ttft_s) / (completion_tokens - 1))

    # -- telemetry --------------------------------------------------------------------------------

    async def subscribe(self, nc: Client) -> None:
        async def on_message(msg: Msg) -> None:
            self.telemetry.update(msg.subject, msg.data)

        await nc.subscribe(subjects.TELEMETRY_ALL, cb=on_message)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestCounter:
    """ASGI middleware: counts every HTTP response by route template and status (500 when one escapes)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in NOT_COUNTED:
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def send_and_record(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            route = scope.get("route")  # set by the router on the scope it shares with us
            endpoint = getattr(route, "path", None) or "other"
            self.metrics.requests.labels(endpoint=endpoint, status=str(status[0] if status else 500)).inc()


def install(app: FastAPI) -> GatewayMetrics:
    """Give `app` its metrics: the request-counting middleware and `GET /metrics` (no API key)."""
    gateway = getattr(app.state, "gateway", None)
    metrics = GatewayMetrics(model_name=gateway.served_model if gateway is not None else "")
    app.state.metrics = metrics
    app.add_middleware(RequestCounter, metrics=metrics)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return metrics

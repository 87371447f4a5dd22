"""The gateway's `/metrics`: request counters and latency histograms, and gauges from telemetry.

Runs the gateway as in production (`serve()`) against the fake scheduler of tests/test_gateway.py, on a
real nats-server, publishes telemetry as workers and the scheduler would, and parses the exposition with
prometheus-client's own parser.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import cast

import httpx2 as httpx
import pytest
from nats.aio.client import Client
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.app import create_app
from services.gateway.metrics import TelemetryCollector
from shared import subjects
from shared.messages import PhaseLatency, SchedulerTelemetry, WorkerTelemetry, encode
from tests.services.gateway.test_gateway import ENERGY_J, MESSAGES, MODEL, Harness

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(base: str) -> Samples:
    r = httpx.get(f"{base}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def attention(**kw: object) -> WorkerTelemetry:
    return WorkerTelemetry.model_validate({
        "worker_id": "attn-0", "role": "attention", "ts": time.time(), "gpu_backend": "emulated",
        "gpu_name": "A800", "clock_mhz": 1410, "target_clock_mhz": 645, "power_w": 187.5, "energy_j": 4321.0,
        "utilization": 0.625, "latency_ms": {"decode": PhaseLatency(mean_ms=4.0, count=3)}, "queue_depth": 1,
        "kv_blocks_used": 17, "kv_blocks_total": 256, "tokens_done": 99, **kw})


@pytest.fixture(scope="module")
def h() -> Iterator[Harness]:
    harness = Harness()
    try:
        yield harness
    finally:
        harness.close()


def test_request_metrics(h: Harness) -> None:
    before = scrape(h.base)
    assert value(before, "aflex_requests_total", endpoint="/v1/chat/completions", status="200") is None
    usages = []
    for _ in range(2):
        resp = h.client.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert resp.usage is not None
        usages.append(resp.usage)
    chunks = list(h.client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                   stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None
    usages.append(chunks[-1].usage)
    assert httpx.post(f"{h.base}/v1/chat/completions", json={"model": MODEL, "messages": []}).status_code == 400
    assert httpx.get(f"{h.base}/v1/models/{MODEL}").status_code == 200

    m = scrape(h.base)
    assert value(m, "aflex_requests_total", endpoint="/v1/chat/completions", status="200") == 3
    assert value(m, "aflex_requests_total", endpoint="/v1/chat/completions", status="400") == 1
    assert value(m, "aflex_requests_total", endpoint="/v1/models/{model:path}", status="200") == 1
    assert not any(name == "aflex_requests_total" and ("endpoint", "/metrics") in labels for name, labels in m)
    assert value(m, "aflex_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert value(m, "aflex_generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert value(m, "aflex_request_energy_joules_total") == pytest.approx(3 * ENERGY_J)
    for name in ("aflex_time_to_first_token_seconds", "aflex_time_per_output_token_seconds",
                 "aflex_e2e_request_latency_seconds"):
        assert value(m, f"{name}_count") == 3, name
        assert value(m, f"{name}_bucket", le="+Inf") == 3, name
    ttft_sum = value(m, "aflex_time_to_first_token_seconds_sum")
    e2e_sum = value(m, "aflex_e2e_request_latency_seconds_sum")
    assert ttft_sum is not None and e2e_sum is not None and 0 < ttft_sum < e2e_sum < 10
    # the fake scheduler spaces deltas by 10 ms: the first token comes after one sleep, the rest after more
    assert e2e_sum / 3 >= 0.05
    # the same observations under vLLM's names, for vLLM's dashboards
    vllm = {"model_name": MODEL}
    assert value(m, "vllm:prompt_tokens_total", **vllm) == value(m, "aflex_prompt_tokens_total")
    assert value(m, "vllm:generation_tokens_total", **vllm) == value(m, "aflex_generation_tokens_total")
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert value(m, f"vllm:{name}_count", **vllm) == 3, name
        assert value(m, f"vllm:{name}_sum", **vllm) == value(m, f"aflex_{name}_sum"), name


def test_telemetry_gauges(h: Harness) -> None:
    ffn = attention(worker_id="ffn-0", role="ffn", clock_mhz=900, target_clock_mhz=None, power_w=250.0,
                    energy_j=9000.5, utilization=0.25, kv_blocks_used=0, kv_blocks_total=0, command_applied=False)
    scheduler = SchedulerTelemetry(scheduler_id="scheduler-0", ts=time.time(), queue_depth=4, running=9, finished=3,
                                   slo_attainment=0.875, ttft_p90_ms=120.0, tpot_p90_ms=30.0,
                                   waiting_by_worker={"attn-0": 3, "attn-1": 0}, running_by_worker={"attn-0": 9})

    async def publish() -> None:
        nc = h.nc
        await nc.publish(subjects.telemetry("attention", "attn-0"), encode(attention(energy_j=4000.0)))
        await nc.publish(subjects.telemetry("attention", "attn-0"), encode(attention()))  # the latest counts
        await nc.publish(subjects.telemetry("ffn", "ffn-0"), encode(ffn))
        await nc.publish(subjects.telemetry("ffn", "bad"), b"{\"worker_id\": 1}")  # dropped, not a crash
        await nc.publish(subjects.telemetry("scheduler", "scheduler-0"), encode(scheduler))
        await nc.flush()

    h.call(publish())
    deadline = time.monotonic() + 5
    while True:
        m = scrape(h.base)
        if value(m, "aflex_scheduler_running") is not None and value(m, "aflex_gpu_power_watts", worker="ffn-0",
                                                                     role="ffn") is not None:
            break
        assert time.monotonic() < deadline, "telemetry never reached /metrics"
        time.sleep(0.05)
    a = {"worker": "attn-0", "role": "attention"}
    f = {"worker": "ffn-0", "role": "ffn"}
    assert value(m, "aflex_gpu_clock_mhz", **a) == 1410 and value(m, "aflex_gpu_clock_mhz", **f) == 900
    assert value(m, "aflex_gpu_target_clock_mhz", **a) == 645
    assert value(m, "aflex_gpu_target_clock_mhz", **f) is None  # no target: no sample
    assert value(m, "aflex_gpu_power_watts", **a) == 187.5 and value(m, "aflex_gpu_power_watts", **f) == 250.0
    assert value(m, "aflex_gpu_energy_joules", **a) == 4321.0 and value(m, "aflex_gpu_energy_joules", **f) == 9000.5
    assert value(m, "aflex_worker_utilization", **a) == 0.625 and value(m, "aflex_worker_utilization", **f) == 0.25
    assert value(m, "aflex_kv_blocks_used", worker="attn-0") == 17
    assert value(m, "aflex_scheduler_queue_depth") == 4 and value(m, "aflex_scheduler_running") == 9
    assert value(m, "aflex_slo_attainment") == 0.875
    vllm = {"model_name": MODEL}
    assert value(m, "vllm:num_requests_waiting", **vllm) == 4 and value(m, "vllm:num_requests_running", **vllm) == 9
    assert value(m, "aflex_num_requests_waiting", worker="attn-0") == 3  # per attention worker (1 unplaced)
    assert value(m, "aflex_num_requests_waiting", worker="attn-1") == 0
    assert value(m, "aflex_num_requests_running", worker="attn-0") == 9
    assert value(m, "vllm:kv_cache_usage_perc", **vllm) == pytest.approx(17 / 256)  # the attention workers' KV
    assert value(m, "vllm:gpu_cache_usage_perc", **vllm) == pytest.approx(17 / 256)  # vLLM's older name
    assert value(m, "aflex_kv_cache_usage_perc", worker="attn-0") == pytest.approx(17 / 256)  # per worker
    assert value(m, "aflex_kv_cache_usage_perc", worker="ffn-0") is None  # an FFN worker holds no KV
    assert not any(("worker", "bad") in labels for _, labels in m)


def test_stale_workers_drop_out() -> None:
    collector = TelemetryCollector(stale_after_s=60)
    collector.update(subjects.telemetry("attention", "attn-0"), encode(attention()))
    assert any(s.labels.get("worker") == "attn-0" for fam in collector.collect() for s in fam.samples)
    collector.stale_after_s = 0.0
    time.sleep(0.01)
    assert not any(s.labels.get("worker") == "attn-0" for fam in collector.collect() for s in fam.samples)


def test_metrics_needs_no_api_key(h: Harness) -> None:
    settings = h.settings.model_copy(update={"api_key": "sekret"})
    app = create_app(settings, h.card, cast(Client, None))  # a second app: its own registry, no clash

    async def check() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            assert (await c.get("/v1/models")).status_code == 401
            r = await c.get("/metrics")
            assert r.status_code == 200
            assert 'aflex_requests_total{endpoint="/v1/models",status="401"} 1.0' in r.text

    asyncio.run(check())


def test_the_global_schedulers_plan_is_exported() -> None:
    from shared.messages import PlanTelemetry

    collector = TelemetryCollector(stale_after_s=60)
    plan = PlanTelemetry(scheduler_id="scheduler-0", ts=time.time(), plan_id=7, kind="mixed",
                         pools={"mixed": [2, 1, 1]}, assignments={"attn-0": "mixed-attention", "attn-1":
                         "mixed-attention", "attn-2": "parked-warm", "ffn-0": "ffn", "ffn-1": "parked-warm"},
                         predicted_power_w=401.5, load_rps=3.25)
    collector.update(subjects.TELEMETRY_PLAN, encode(plan))
    m: Samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in collector.collect()
                  for s in fam.samples}
    assert value(m, "aflex_worker_assignment", worker="attn-2", assignment="parked-warm") == 1
    assert value(m, "aflex_worker_assignment", worker="attn-0", assignment="mixed-attention") == 1
    assert value(m, "aflex_plans") == 7 and value(m, "aflex_plan_parked_workers") == 2
    assert value(m, "aflex_plan_load_rps") == 3.25 and value(m, "aflex_plan_predicted_power_watts") == 401.5
    infeasible = plan.model_copy(update={"plan_id": 8, "feasible": False, "ts": time.time() + 1})
    collector.update(subjects.TELEMETRY_PLAN, encode(infeasible))
    names = {s.name for fam in collector.collect() for s in fam.samples}
    assert "aflex_plan_predicted_power_watts" not in names and "aflex_plans" in names

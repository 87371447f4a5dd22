"""Admission refuses what would wait too long: past `max_queue` requests, or a backlog that would keep a new
request more than `max_queue_wait_s` beyond the usual service time (so that the ones it serves keep their latency);
the TPOT guard stops a running set growing past the size that met the SLO lately."""

from __future__ import annotations

import pytest

from services.scheduler.admission import MAX_RETRY_AFTER_S, Mesh, rejection
from services.scheduler.governor import DRAIN_MIN_FINISHED, Governor
from services.scheduler.model_info import ModelInfo
from services.scheduler.overload import GUARD_MEMORY_S, GUARD_STEPS, RunningGuard
from services.scheduler.registry import Registry
from services.scheduler.state import RequestState
from shared.messages import SamplingSpec, SubmitRequest
from shared.settings import SchedulerSettings

REQ = SubmitRequest(request_id="r1", model="m", prompt_ids=[1, 2, 3], sampling=SamplingSpec(max_tokens=4),
                    arrival_ts=0.0)


def mesh(depth: int, wait_s: float | None, max_wait_s: float = 10.0) -> Mesh:
    return Mesh(running_ids=(), ready=True, context_limit=1024, vocab_size=100, queue_depth=depth, max_queue=1000,
                queue_wait_s=wait_s, max_queue_wait_s=max_wait_s)


def test_a_queue_holding_more_than_max_queue_wait_s_of_work_is_a_429() -> None:
    assert rejection(REQ, mesh(50, 9.0)) is None
    refused = rejection(REQ, mesh(50, 25.0))
    assert refused is not None
    error, retry_after_s = refused
    assert error.type == "overloaded_error" and error.code == "queue_full" and "about 25.0 s more" in error.message
    assert retry_after_s == 15.0
    far = rejection(REQ, mesh(50, 1e9))
    assert far is not None and far[1] == MAX_RETRY_AFTER_S  # Retry-After is capped
    assert rejection(REQ, mesh(50, None)) is None  # no estimate yet: only max_queue holds


def test_the_wait_estimate_is_the_queue_over_the_recent_finish_rate() -> None:
    governor = Governor(SchedulerSettings(), ModelInfo("m", frozenset({2}), 100, 1024), Registry())
    def unfinished(n: int, since: float) -> list[RequestState]:
        return [RequestState(f"u{i}", [1], SamplingSpec(), 0.0, received_mono=since) for i in range(n)]

    assert governor.queue_wait_s(unfinished(40, 99.0), 100.0) is None  # nothing served yet
    for i in range(DRAIN_MIN_FINISHED * 2):  # 10 requests finished over 4.5 s (about 2 a second), 3 s each
        governor.finished(RequestState(f"r{i}", [1], SamplingSpec(), 0.0, received_mono=92.5 + i * 0.5), "stop",
                          95.5 + i * 0.5)
    assert governor.queue_wait_s(unfinished(40, 99.0), 100.0) == pytest.approx(40 / (10 / 4.5) - 3.0)  # Little
    assert governor.queue_wait_s(unfinished(4, 99.0), 100.0) == 0.0  # no backlog beyond what is being served
    # nothing finished lately: the oldest unfinished request's age tells a burst after idling from a backlog
    assert governor.queue_wait_s(unfinished(40, 199.0), 200.0) == 0.0
    assert governor.queue_wait_s(unfinished(40, 170.0), 200.0) == pytest.approx(30.0 - 3.0)


def test_the_running_set_stops_growing_past_the_size_that_met_the_tpot_slo() -> None:
    guard = RunningGuard(tpot_slo_s=0.1)
    for i in range(GUARD_STEPS):
        guard.step(10.0 + i, 4, 0.05)  # 4 running: within
    assert not guard.full(20.0, 4)
    for i in range(GUARD_STEPS):
        guard.step(20.0 + i, 8, 0.15)  # 8 running: over
    assert guard.full(30.0, 8) and guard.full(30.0, 4)  # 4 met it: hold at 4 and above
    assert not guard.full(30.0, 3)  # below that, grow back to it
    assert not guard.full(30.0 + GUARD_MEMORY_S, 8)  # what met it is forgotten after a while


def test_a_tpot_slo_out_of_reach_at_any_size_does_not_hold_the_running_set() -> None:
    guard = RunningGuard(tpot_slo_s=0.01)
    for n in range(1, GUARD_STEPS + 1):
        guard.step(float(n), n, 0.05)  # even one running is over: serve for throughput
    assert not guard.full(10.0, GUARD_STEPS)

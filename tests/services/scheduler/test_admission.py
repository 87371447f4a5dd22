"""Overload, measured (overload.py): admission refuses a request that would wait more than
`max_queue_wait_s` to start, at the rate requests start while the queue is never empty (a burst after
idling has no rate and is let in); a worker's running set stops growing while its decode steps are
over the TPOT SLO that it met lately with as many running."""

from __future__ import annotations

import pytest

from services.scheduler.admission import MAX_RETRY_AFTER_S, Mesh, rejection
from services.scheduler.overload import GUARD_MEMORY_S, GUARD_STEPS, QueueDrain, RunningGuard
from shared.messages import SamplingSpec, SubmitRequest

REQ = SubmitRequest(request_id="r1", model="m", prompt_ids=[1, 2, 3], sampling=SamplingSpec(max_tokens=4),
                    arrival_ts=0.0)


def mesh(depth: int, wait_s: float | None, max_wait_s: float = 10.0) -> Mesh:
    return Mesh(running_ids=(), ready=True, context_limit=1024, vocab_size=100, queue_depth=depth, max_queue=1000,
                queue_wait_s=wait_s, max_queue_wait_s=max_wait_s)


def test_a_request_that_would_wait_more_than_max_queue_wait_s_to_start_is_a_429() -> None:
    assert rejection(REQ, mesh(50, 9.0)) is None
    refused = rejection(REQ, mesh(50, 25.0))
    assert refused is not None
    error, retry_after_s = refused
    assert error.type == "overloaded_error" and error.code == "queue_full" and "about 25.0 s to start" in error.message
    assert retry_after_s == 15.0
    far = rejection(REQ, mesh(50, 1e9))
    assert far is not None and far[1] == MAX_RETRY_AFTER_S  # Retry-After is capped
    assert rejection(REQ, mesh(50, None)) is None  # no estimate yet: only max_queue holds


def test_the_wait_is_the_queue_over_the_rate_requests_started_while_it_was_never_empty() -> None:
    drain = QueueDrain()
    assert drain.wait_s(100.0, 0) == 0.0  # nobody ahead
    assert drain.wait_s(100.0, 32) is None  # a burst after idling: no rate yet, let in
    for i in range(8):  # 2 start a second, the queue never empty
        drain.started(100.5 + i * 0.5, 1, 31 - i)
    assert drain.wait_s(104.0, 40) == pytest.approx(40 / (8 / 4.0))
    drain.started(104.5, 24, 0)  # it emptied: the spell is over
    assert drain.wait_s(105.0, 0) == 0.0
    assert drain.wait_s(105.0, 10) is None  # a new spell measures afresh


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

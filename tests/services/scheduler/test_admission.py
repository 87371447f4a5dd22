"""Overload, the pure parts: a request that waited `queue_deadline_s` without starting is shed with a 429
(one that started, or streamed anything, never is); the running-set bound holds a worker's steps to the
TPOT SLO where that is at least two unloaded steps (else, in "auto", only max_num_seqs bounds it)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from services.scheduler.admission import overdue, shed
from services.scheduler.running_bound import RECENT_STEPS, RunningBound
from services.scheduler.state import RequestState, Status
from shared.messages import SamplingSpec


def waiting(received_mono: float, **fields: object) -> RequestState:
    state = RequestState("r1", [1, 2, 3], SamplingSpec(max_tokens=4), 0.0, received_mono=received_mono)
    for name, value in fields.items():
        setattr(state, name, value)
    return state


def test_a_request_waiting_past_the_deadline_is_shed_with_a_429() -> None:
    assert overdue(waiting(100.0), 109.9, 10.0) is None
    error = overdue(waiting(100.0), 110.5, 10.0)
    assert error is not None and error.type == "overloaded_error" and error.code == "queue_deadline"
    assert "waited 10.5 s without starting (queue_deadline_s=10)" in error.message


def test_a_request_that_started_or_streamed_is_never_shed() -> None:
    assert overdue(waiting(100.0, started=True), 200.0, 10.0) is None  # put back by a fault: keeps its turn
    assert overdue(waiting(100.0, base_tokens=3), 200.0, 10.0) is None  # a continuation: its client has text
    assert overdue(waiting(100.0, output_ids=[7]), 200.0, 10.0) is None
    assert overdue(waiting(100.0), 1e9, float("inf")) is None  # inf: never
    assert overdue(waiting(100.0, choice_of="r0"), 200.0, 10.0) is None  # choice 1 of n goes with choice 0


def test_shed_refuses_only_the_overdue_waiting_and_passes_over_one_that_started_meanwhile() -> None:
    due, fresh, running, later = waiting(100.0), waiting(109.0), waiting(100.0, status=Status.RUNNING), waiting(100.0)
    refusals = shed([due, fresh, running, later], 110.5, 10.0, ready=True)
    first = next(refusals)
    assert first[0] is due and first[1].code == "queue_deadline"
    later.started = True  # taken into a running set while the first refusal was sent
    assert list(refusals) == []
    assert [s for s, _ in shed([due], 110.5, 10.0, ready=False)] == [due]


def test_while_no_workers_are_ready_an_overdue_request_is_a_503() -> None:
    error = overdue(waiting(100.0), 110.5, 10.0, ready=False)
    assert error is not None and error.type == "service_unavailable_error" and error.code == "no_workers_ready"


def linear(fixed_s: float, per_seq_s: float) -> Callable[[int], float]:
    return lambda n: fixed_s + per_seq_s * n


def settle(bound: RunningBound, step_s: Callable[[int], float], n: int = 1, steps: int = 400) -> int:
    """Run a worker whose queue never empties under the bound; the running-set size it settles at."""
    sizes: list[int] = []
    for _ in range(steps):
        bound.step(n, step_s(n))
        sizes.append(n)
        cap = bound.bound(n)
        n = cap if cap is not None else n + 1
    return round(statistics.median(sizes[-100:]))


def test_where_the_slo_costs_most_of_the_throughput_auto_leaves_the_set_to_max_num_seqs() -> None:
    cpu = linear(0.1, 0.017)  # the SmolLM2 mesh on 2 cores: the 120 ms SLO holds one sequence
    bound = RunningBound(0.12)
    settle(bound, cpu, steps=50)
    assert bound.target_s is None and bound.bound(40) is None
    assert settle(RunningBound(0.12, "slo"), cpu) == 1  # the SLO's size, whatever it costs
    off = RunningBound(0.12, "off")
    off.step(3, 0.2)
    assert off.bound(3) is None and off.target_s is None


def test_where_the_slo_holds_many_sequences_the_set_settles_at_the_slo() -> None:
    gpu = linear(0.02, 0.0002)  # a step grows slowly with the set: 500 sequences meet 120 ms
    bound = RunningBound(0.12)
    n = settle(bound, gpu, steps=800)
    assert bound.target_s == 0.12
    assert abs(gpu(n) - 0.12) <= 0.05 * 0.12


def test_a_concave_cost_settles_at_the_target_without_overshooting() -> None:
    bound = RunningBound(0.12)
    concave = lambda n: 0.01 + 0.003 * n ** 0.8  # noqa: E731
    n = settle(bound, concave, steps=1000)
    assert bound.target_s == 0.12
    assert 0.95 * 0.12 <= concave(n) <= 0.12 * 1.02


def test_a_slow_step_stops_new_sequences_until_the_set_is_smaller() -> None:
    bound = RunningBound(0.12)
    for _ in range(RECENT_STEPS):
        bound.step(4, 0.01)
    assert bound.bound(4) == 48  # below the target: grow to the last step's size scaled to it (4 x 120 / 10)
    assert bound.bound(0) is None  # nothing runs: a burst is taken whole
    bound.step(4, 0.5)
    assert bound.bound(4) == 4  # the last step passed it: hold
    for _ in range(RECENT_STEPS):
        bound.step(4, 0.5)
    assert bound.bound(40) == 39  # most recent steps pass it: nothing new starts
    assert RunningBound(0.12).bound(4) is None  # nothing seen: max_num_seqs alone

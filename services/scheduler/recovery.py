"""Failure recovery: in-flight microbatches, lost workers, lost descriptors, and recompute.

A request's token history lives in dispatch, a worker's KV is disposable. A sequence the worker
refuses (`failed_seq_ids`, e.g. KV exhausted), a microbatch that errs or times out, and an attention
worker that stops heartbeating or restarts all lead to the same thing: the sequence is taken off
its worker and recomputed from its prompt + output tokens (`take_back`). After MAX_FAILURES errors
(not KV refusals, not a lost message) a request ends with finish_reason "error".

`InFlight` tracks every microbatch sent and not yet settled; the ways it can fail are typed:
`WorkerLostError` (its worker stopped heartbeating or restarted) and `MicrobatchLostError` (the
worker is alive, its heartbeat does not list it: the descriptor or its `MicrobatchDone` was lost,
e.g. while the scheduler's NATS connection was down; not the sequences' fault).

Every blame rule lives here: `judge` turns a microbatch's outcome (its Done, the error it failed
with, or nothing within the timeout) into one `Verdict` per sequence and, where the FFN worker could
not be reached, the worker to route around; `SeamAvoidance` says which decode workers a KV handoff
avoids after one could not reach their KV seam. Dispatch and handoff.py only apply them.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from services.scheduler.registry import Worker
from services.scheduler.state import RequestState
from shared.error_types import (
    FFN_UNREACHABLE,
    FORK_PARENT_MISSING,
    KV_HANDOFF_MISSING,
    KV_HANDOFF_UNREACHABLE,
    PREFIX_MISSING,
    SEQUENCE_BUSY,
    ErrorType,
)
from shared.errors import AFlexError
from shared.messages import ErrorBody, KVHandoffReply, MicrobatchDone, SeqResult

MAX_FAILURES = 3  # errored passes of one request before it ends with finish_reason "error"
LOST_CONFIRM_S = 0.5  # how long a microbatch missing from a heartbeat has to turn up done before it is lost
KV_SEAM_AVOID_S = 5.0  # a decode worker whose KV seam could not be reached gets no KV moves this long
ORDER_MEMORY = 256  # descriptors per worker whose send order is kept, for the heartbeats' `newest_mb_id`
# Refusals that are no sequence's fault, so not counted against it (shared/error_types.py says what each means).
BLAMELESS_CODES = frozenset({FFN_UNREACHABLE, SEQUENCE_BUSY, FORK_PARENT_MISSING, KV_HANDOFF_MISSING, PREFIX_MISSING})


class WorkerLostError(AFlexError):
    """The attention worker of an in-flight microbatch stopped heartbeating or restarted."""


class MicrobatchLostError(AFlexError):
    """A microbatch's descriptor or its MicrobatchDone was lost: its worker, alive, does not have it."""


@dataclass(frozen=True)
class Sent:
    """A microbatch the scheduler sent and awaits."""

    worker_id: str
    done: asyncio.Future[MicrobatchDone]
    sent_at: float  # time.monotonic() its descriptor was published
    order: int  # its place among every descriptor sent
    ffn_worker_id: str = ""  # the FFN worker its hops go to ("": colocated, or not said)


class InFlight:
    """Every microbatch sent and not yet settled, by id."""

    def __init__(self) -> None:
        self.sent: dict[str, Sent] = {}
        self.bus_suspects: set[str] = set()  # in flight when the connection dropped: their Done may be lost
        self._orders: dict[str, OrderedDict[str, int]] = {}  # worker -> mb id -> send order, its latest few
        self._sends = 0

    def note_sent(self, mb_id: str, worker_id: str) -> int:
        """A descriptor is being published (tracked or not, as a release-only one): its send order."""
        orders = self._orders.setdefault(worker_id, OrderedDict())
        order = orders[mb_id] = self._sends
        self._sends += 1
        if len(orders) > ORDER_MEMORY:
            orders.popitem(last=False)
        return order

    def track(self, mb_id: str, worker_id: str, now: float, ffn_worker_id: str = "") -> asyncio.Future[MicrobatchDone]:
        fut: asyncio.Future[MicrobatchDone] = asyncio.get_running_loop().create_future()
        self.sent[mb_id] = Sent(worker_id, fut, now, self.note_sent(mb_id, worker_id), ffn_worker_id)
        return fut

    def holds(self, worker_id: str) -> bool:
        """Whether a microbatch in flight runs on `worker_id` (its attention or its FFN side)."""
        return any(worker_id in (s.worker_id, s.ffn_worker_id) for s in self.sent.values())

    def forget(self, mb_id: str) -> None:
        self.sent.pop(mb_id, None)
        self.bus_suspects.discard(mb_id)

    def settle(self, done: MicrobatchDone) -> None:
        entry = self.sent.get(done.mb_id)
        if entry is not None and not entry.done.done():
            entry.done.set_result(done)

    def _fail(self, worker_id: str | None, make: type[AFlexError], why: str) -> None:
        for mb_id, entry in list(self.sent.items()):
            if (worker_id is None or entry.worker_id == worker_id) and not entry.done.done():
                entry.done.set_exception(make(why.format(worker=entry.worker_id, mb_id=mb_id)))

    def worker_lost(self, worker_id: str) -> None:
        self._fail(worker_id, WorkerLostError, "attention worker {worker} lost while running {mb_id}")

    def bus_lost(self) -> None:
        """A `MicrobatchDone` (or the descriptor itself) may have gone with the connection: every in-flight
        microbatch is a suspect that the worker's next heartbeat settles (still running: wait for it; not
        there: lost now). Not given up at once: on a NATS cluster the worker may be running it still, and
        would refuse its sequences sent again (`sequence_busy`)."""
        self.bus_suspects |= {mb_id for mb_id, e in self.sent.items() if not e.done.done()}

    def check_heartbeat(self, worker_id: str, active: set[str], now: float, grace_s: float,
                        newest_mb_id: str | None = None) -> None:
        """Microbatches of `worker_id` sent over `grace_s` ago that its heartbeat does not list are
        suspects; one still not done a moment later (a MicrobatchDone sent just before the heartbeat
        may still be in the scheduler's queue) was lost and fails now, not at its timeout. One sent after
        `newest_mb_id`, the newest descriptor the worker has taken, has not reached it yet (a saturated
        worker takes its messages late; NATS keeps one publisher's order) and is no suspect, unless the
        scheduler's connection dropped since it was sent (a worker whose own dropped, or whose messages
        were dropped as a slow consumer, reports no newest until it takes another)."""
        orders = self._orders.get(worker_id)
        newest = orders.get(newest_mb_id) if orders is not None and newest_mb_id else None  # None: as if all taken
        suspects = [mb_id for mb_id, e in self.sent.items()
                    if e.worker_id == worker_id and not e.done.done() and mb_id not in active
                    and (mb_id in self.bus_suspects or (now - e.sent_at > grace_s
                                                        and (newest is None or e.order <= newest)))]
        if suspects:
            asyncio.get_running_loop().call_later(LOST_CONFIRM_S, self._fail_lost, worker_id, suspects)

    def _fail_lost(self, worker_id: str, mb_ids: list[str]) -> None:
        for mb_id in mb_ids:
            entry = self.sent.get(mb_id)
            if entry is not None and not entry.done.done():
                when = " (in flight when the NATS connection dropped)" if mb_id in self.bus_suspects else ""
                entry.done.set_exception(MicrobatchLostError(
                    f"{worker_id} is alive but does not have microbatch {mb_id}{when}: its descriptor or its "
                    "MicrobatchDone was lost"))


def lose(worker: Worker, in_flight: InFlight, *, restarted: bool) -> None:
    """The worker's KV can no longer be trusted: fail its in-flight microbatches, let its loop evacuate."""
    worker.lane.lose(restarted=restarted)
    in_flight.worker_lost(worker.worker_id)


def take_back(worker: Worker, state: RequestState, *, failure: bool, reason: str) -> ErrorBody | None:
    """Take `state` off `worker` for recomputation elsewhere (or there again). Returns None when it should
    be routed again (at the front), or the error it ends with after MAX_FAILURES failures."""
    worker.lane.release(state, holds_kv=bool(state.num_computed or state.first_pass_sent))
    state.reset_for_recompute()
    if not failure:
        return None
    state.failures += 1
    if state.failures < MAX_FAILURES:
        return None
    return ErrorBody(type=ErrorType.SERVER_ERROR, message=f"request failed {state.failures} times; last: {reason}",
                     code="request_failed")


def evacuate(worker: Worker) -> list[RequestState]:
    """Take back everything a lost or restarted worker held or had queued (none of it their failure);
    returns them, in order, to be routed again. If the worker is unhealthy, what it held is released
    when it comes back without restarting (see `lose`)."""
    states = worker.lane.evacuate()
    moved = [s for s in states if s.worker_id == worker.worker_id and not s.finished]
    for state in moved:
        take_back(worker, state, failure=False, reason=f"worker {worker.worker_id} lost")
    if not worker.healthy:  # every sequence it may hold, and what was already to be released there (those of
        worker.lane.owe_releases(s.request_id for s in states)  # the microbatch it went silent in, taken back
    return moved


# -- verdicts -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """What one sequence of a microbatch gets. `result` set: it stands (apply it). Otherwise the sequence is
    taken back and sent again, counted as one of its MAX_FAILURES when `blamed` (else not its fault)."""

    seq_id: str
    result: SeqResult | None = None
    ok: bool = True
    blamed: bool = False
    reason: str = ""
    code: str | None = None  # the refusal's code, when the worker gave one


@dataclass(frozen=True)
class Judgement:
    """A microbatch's verdicts, in its sequences' order, and what it says of the workers."""

    verdicts: list[Verdict]
    whole: bool  # came back with no error and nothing refused: its step time says what a step costs
    unreachable_ffn: str | None = None  # an FFN worker the attention worker could not reach: route around it
    why: str = ""


def judge(outcome: MicrobatchDone | BaseException | None, seq_ids: Sequence[str], samples: Sequence[bool],
          ffn_worker_id: str, timeout_s: float, mb_id: str) -> Judgement:
    """The one place that decides what a microbatch's outcome costs each of its sequences.

    `outcome`: its `MicrobatchDone`, the error its wait failed with, or None when nothing came within
    `timeout_s`. A lost descriptor or Done (`MicrobatchLostError`) and the `BLAMELESS_CODES` refusals are
    no sequence's fault; a worker lost, a timeout, any other error and a pass that sampled nothing are.
    """
    if not isinstance(outcome, MicrobatchDone):
        reason = str(outcome) if outcome is not None else f"no MicrobatchDone for {mb_id} within {timeout_s:.1f} s"
        blamed = not isinstance(outcome, MicrobatchLostError)
        return Judgement([Verdict(s, ok=False, blamed=blamed, reason=reason) for s in seq_ids], whole=False)
    done = outcome
    error = done.error
    failed = set(done.failed_seq_ids) or (set(seq_ids) if error is not None else set())
    results = {r.seq_id: r for r in done.results}
    verdicts = []
    for seq_id, sample in zip(seq_ids, samples, strict=True):
        result = results.get(seq_id)
        if seq_id in failed:
            code = done.failed_codes.get(seq_id) or (error.code if error else None)
            verdicts.append(Verdict(seq_id, ok=False, blamed=code is not None and code not in BLAMELESS_CODES,
                                    reason=error.message if error else "the worker refused it (KV cache exhausted)",
                                    code=code))
        elif sample and (result is None or result.token_id is None):
            verdicts.append(Verdict(seq_id, ok=False, blamed=True, reason="the worker sampled no token"))
        else:
            verdicts.append(Verdict(seq_id, result))
    unreachable = error is not None and error.code == FFN_UNREACHABLE
    return Judgement(verdicts, whole=error is None and not done.failed_seq_ids,
                     unreachable_ffn=ffn_worker_id if unreachable else None, why=error.message if error else "")


class SeamAvoidance:
    """Decode workers whose KV seam a prefill worker could not reach. Not `Registry.suspect`: the worker is
    alive on NATS and serves what it holds; only KV moves to it stop, for `avoid_s`, then are tried again."""

    def __init__(self, avoid_s: float = KV_SEAM_AVOID_S) -> None:
        self.avoid_s = avoid_s
        self._until: dict[str, float] = {}  # worker -> monotonic time it may take moves again

    def handoff_failed(self, target_id: str, reply: KVHandoffReply | None, now: float) -> None:
        """A move to `target_id` failed with `reply` (None: no reply): avoid it if its seam was unreachable."""
        if reply is not None and reply.error is not None and reply.error.code == KV_HANDOFF_UNREACHABLE:
            self._until[target_id] = now + self.avoid_s

    def avoided(self, worker_id: str, now: float) -> bool:
        return self._until.get(worker_id, 0.0) > now

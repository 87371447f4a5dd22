"""Workers the scheduler knows: capabilities from `Register`, liveness and KV load from heartbeats.

A worker is healthy while heartbeats (or MicrobatchDone reports) keep arriving within
`heartbeat_timeout_s`. Each attention worker also has a lane (`AttentionLane`): its queue, running
set and KV estimate, because a request's KV lives on exactly one attention worker; FFN workers are
stateless between microbatches, so any healthy one can serve any microbatch (round-robin), and have
no lane.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field

from services.scheduler.state import RequestState, Status
from shared.kinds import PARKED, Assignment, decodes_only, runs_own_ffn
from shared.messages import Heartbeat, Register, Role, WorkerInfo
from shared.policy.iteration import KvRoom

log = logging.getLogger("aflex.scheduler")


@dataclass(eq=False)
class AttentionLane:
    """Dispatch's state for one attention worker: what is queued on it, running on it, and in its KV.

    A request's place on the worker changes only through the methods below (queue, admit, detach,
    release, move, lose, evacuate), so the lists, the KV reservations and the releases owed to the worker
    change together and the loop is woken wherever there is new work for it.
    """

    block_size: int = 0
    kv_free_blocks: int = 0  # as last reported
    waiting: deque[RequestState] = field(default_factory=deque)
    running: list[RequestState] = field(default_factory=list)
    pending_release: list[str] = field(default_factory=list)  # sent with the next descriptor
    reserved_blocks: dict[str, int] = field(default_factory=dict)  # our estimate, until a report shows it
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    epoch: int = 0  # bumped when the worker is lost or restarts: its KV can no longer be trusted
    iteration: int = 0
    task: asyncio.Task[None] | None = None

    @property
    def est_free_blocks(self) -> int:
        """Free KV blocks as last reported, less what we routed here since (our own estimate)."""
        return self.kv_free_blocks - sum(self.reserved_blocks.values())

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size) if self.block_size > 0 else 0

    def kv_room(self) -> KvRoom[RequestState]:
        """The KV estimate as the iteration planner reads it (reservations are per request id)."""
        reserved = {s: self.reserved_blocks.get(s.request_id, 0) for s in self.waiting}
        return KvRoom(self.est_free_blocks, self.block_size, reserved, holds_running=bool(self.running))

    # -- a request's moves ----------------------------------------------------------------------

    def queue(self, state: RequestState, tokens: int, *, front: bool = False) -> None:
        """Queue `state` here (at the front: it keeps its turn), its `tokens` of KV reserved until a report
        shows them; the loop wakes to consider it."""
        self.reserved_blocks[state.request_id] = self.blocks_for(tokens)
        if front:
            self.waiting.appendleft(state)
        else:
            self.waiting.append(state)
        self.wake.set()

    def admit(self, states: list[RequestState]) -> None:
        """The iteration planner took `states` from the queue: they run here from now on."""
        for state in states:
            self.waiting.remove(state)
            self.running.append(state)
            state.status = Status.RUNNING
            state.started = True

    def settled(self, state: RequestState) -> None:
        """A microbatch with `state` came back: the worker's KV report counts it now, our reservation goes."""
        self.reserved_blocks.pop(state.request_id, None)

    def detach(self, state: RequestState) -> None:
        """Take `state` off this lane, wherever it is; what the worker holds of it stays (see `release`)."""
        if state in self.running:
            self.running.remove(state)
        if state in self.waiting:
            self.waiting.remove(state)
        self.reserved_blocks.pop(state.request_id, None)

    def release(self, state: RequestState, *, holds_kv: bool = True) -> None:
        """Take `state` off this lane; when the worker `holds_kv` of it, free that KV with the next descriptor
        (the loop wakes to send it, with work or alone)."""
        self.detach(state)
        if holds_kv:
            self.pending_release.append(state.request_id)
            self.wake.set()

    def move(self, state: RequestState, to: AttentionLane, tokens: int) -> None:
        """`state`'s KV went to `to`'s worker (a P/D handoff): released here, running there with `tokens` of KV
        reserved; both loops wake."""
        self.release(state)
        to.reserved_blocks[state.request_id] = to.blocks_for(tokens)
        to.running.append(state)
        state.status = Status.RUNNING
        to.wake.set()

    def lose(self, *, restarted: bool) -> None:
        """The worker's KV can no longer be trusted: a new epoch, and the loop wakes to evacuate (`evacuate`). A
        restarted worker holds nothing, so nothing is released there."""
        self.epoch += 1
        if restarted:
            self.pending_release.clear()
        self.wake.set()

    def evacuate(self) -> list[RequestState]:
        """What runs and waits here, in that order, every KV reservation dropped: they are to be taken back."""
        self.reserved_blocks.clear()
        return [*self.running, *self.waiting]

    def owe_releases(self, request_ids: Iterable[str]) -> None:
        """Free these sequences' KV with the next descriptor the worker takes (each once)."""
        pending = set(self.pending_release)
        self.pending_release.extend(r for r in request_ids if r not in pending)

    def take_releases(self, keep: Container[str] = ()) -> list[str]:
        """The releases to send now (all but those in `keep`, which wait for a later descriptor)."""
        release = [r for r in self.pending_release if r not in keep]
        self.pending_release = [r for r in self.pending_release if r in keep]
        return release

    def next_iteration(self) -> int:
        self.iteration += 1
        return self.iteration


@dataclass(eq=False)
class Worker:
    """What the registry knows of a worker: its capabilities and liveness (and, attention only, a lane)."""

    worker_id: str
    role: Role
    registered: bool = False
    model_id: str = ""
    kv_total_blocks: int = 0
    max_seq_len: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    healthy: bool = True
    gpu_backend: str = ""
    gpu_name: str = ""
    gpu_profile: str = ""  # as registered; the scheduler resolves it (or the name) to a profile
    supported_clocks_mhz: list[int] = field(default_factory=list)  # empty: no frequency commands
    attention_lane: AttentionLane | None = None
    assignment: Assignment | None = None  # the global scheduler's (None: no plan yet, or provisioning off)
    pool: str = ""  # the plan's pool it serves in ("prefill", "decode", "mixed"; "": none, or no plan)
    kv_address: str = ""  # an attention worker's KV seam (P/D handoffs); "": it takes none
    halves: tuple[Role, ...] = ()  # what it loaded beyond its role's half (`Register.halves`)
    gpu_energy_j: float | None = None  # its GPU's energy counter, as its latest heartbeat said
    gpu_memory_bytes: float = 0.0  # as registered (0: unknown)
    group_size: int = 1  # its devices: a worker group's ranks (`Register.group_devices`), else one
    draining: bool = False  # stopping (its heartbeat says so): no new work; what it holds finishes there

    @property
    def can_colocate(self) -> bool:
        """An attention worker holding the FFN half too: it can serve the whole model (`colocated`)."""
        return self.role == "attention" and "ffn" in self.halves

    @property
    def parked(self) -> bool:
        """Parked by the global scheduler: it takes no new work (what it holds finishes first)."""
        return self.assignment in PARKED

    @property
    def drained(self) -> bool:
        """Nothing queued or running on it (an FFN worker holds nothing between microbatches)."""
        lane = self.attention_lane
        return lane is None or not (lane.waiting or lane.running)

    def __post_init__(self) -> None:
        if self.role == "attention" and self.attention_lane is None:
            self.attention_lane = AttentionLane()

    @property
    def lane(self) -> AttentionLane:
        if self.attention_lane is None:
            raise TypeError(f"worker {self.worker_id} is an {self.role} worker: it has no attention lane")
        return self.attention_lane

    @property
    def block_size(self) -> int:
        return self.attention_lane.block_size if self.attention_lane else 0

    @property
    def kv_free_blocks(self) -> int:
        return self.attention_lane.kv_free_blocks if self.attention_lane else 0

    def report_kv(self, free_blocks: int, total_blocks: int) -> None:
        self.kv_total_blocks = total_blocks
        if self.attention_lane is not None:
            self.attention_lane.kv_free_blocks = free_blocks

    @property
    def capacity_tokens(self) -> int:
        """Longest sequence (prompt + max_tokens) this worker can hold; 0 when unknown."""
        limits = [x for x in (self.kv_total_blocks * self.block_size, self.max_seq_len) if x > 0]
        return min(limits) if limits and self.block_size > 0 else 0

    def info(self, now: float) -> WorkerInfo:
        return WorkerInfo(worker_id=self.worker_id, role=self.role, healthy=self.healthy,
                          kv_free_blocks=self.kv_free_blocks, kv_total_blocks=self.kv_total_blocks,
                          last_seen_s_ago=round(now - self.last_seen, 3), assignment=self.assignment)


class Registry:
    def __init__(self) -> None:
        self.workers: dict[str, Worker] = {}
        self._ffn_turn = 0

    def register(self, msg: Register, now: float) -> tuple[Worker, bool]:
        """Add or refresh a worker; returns (worker, restarted) where restarted means it was known."""
        worker = self.workers.get(msg.worker_id)
        restarted = worker is not None and worker.registered
        if worker is None or worker.role != msg.role:
            worker = Worker(msg.worker_id, msg.role)
            self.workers[msg.worker_id] = worker
        worker.registered = True
        worker.model_id = msg.model_id
        worker.report_kv(msg.kv_total_blocks, msg.kv_total_blocks)  # a (re)started worker has an empty cache
        if worker.attention_lane is not None:
            worker.attention_lane.block_size = msg.block_size
        worker.max_seq_len = msg.max_seq_len
        worker.gpu_backend, worker.gpu_name, worker.gpu_profile = msg.gpu_backend, msg.gpu_name, msg.gpu_profile
        worker.supported_clocks_mhz = sorted({c for c in msg.supported_clocks_mhz if c > 0})
        worker.kv_address = msg.kv_address
        worker.halves = tuple(msg.halves)
        worker.gpu_memory_bytes = msg.gpu_memory_bytes
        worker.group_size = max(1, len(msg.group_devices))
        worker.draining = False  # a new process: it drains again only when its heartbeat says so
        worker.last_seen = now
        worker.healthy = True
        return worker, restarted

    def heartbeat(self, msg: Heartbeat, now: float) -> tuple[Worker, bool]:
        """Record liveness; returns (worker, revived) where revived means it was unhealthy."""
        worker = self.workers.get(msg.worker_id)
        if worker is None:  # e.g. the scheduler restarted: known from now on, capacity unknown
            worker = Worker(msg.worker_id, msg.role)
            self.workers[msg.worker_id] = worker
        revived = not worker.healthy
        worker.last_seen = now
        worker.healthy = True
        worker.gpu_energy_j = msg.gpu_energy_j
        if msg.kv_total_blocks:
            worker.report_kv(msg.kv_free_blocks, msg.kv_total_blocks)
        return worker, revived

    def suspect(self, worker_id: str, why: str) -> None:
        """A worker others could not reach: unhealthy (routed around) until its next heartbeat."""
        worker = self.workers.get(worker_id)
        if worker is not None and worker.healthy:
            worker.healthy = False
            log.warning("worker %s unreachable, routed around until heard from: %s", worker_id, why)

    def expire(self, now: float, timeout_s: float) -> list[Worker]:
        """Mark workers silent for longer than `timeout_s` unhealthy; returns the newly unhealthy."""
        lost = []
        for worker in self.workers.values():
            if worker.healthy and now - worker.last_seen > timeout_s:
                worker.healthy = False
                lost.append(worker)
        return lost

    def healthy(self, role: Role) -> list[Worker]:
        return sorted((w for w in self.workers.values() if w.role == role and w.healthy),
                      key=lambda w: w.worker_id)

    def lanes(self) -> list[AttentionLane]:
        """The lane of every attention worker known, healthy or not."""
        return [w.attention_lane for w in self.workers.values() if w.attention_lane is not None]

    def attention_workers(self) -> list[Worker]:
        """Healthy attention workers whose capacity we know (they registered), parked or not."""
        return [w for w in self.healthy("attention") if w.capacity_tokens > 0]

    def usable_attention(self) -> list[Worker]:
        """The attention workers new requests may go to: registered, healthy, neither parked nor draining."""
        return [w for w in self.attention_workers() if not (w.parked or w.draining)]

    def serving(self, role: Role) -> list[Worker]:
        """Healthy workers of `role` that take new work: not parked by the global scheduler, not draining."""
        return [w for w in self.healthy(role) if not (w.parked or w.draining)]

    @property
    def ready(self) -> bool:
        """New requests can be served: a usable attention worker with an FFN that is not draining."""
        ffn_takes_new = any(not f.draining for f in self.healthy("ffn"))
        return any(ffn_takes_new or runs_own_ffn(w.assignment) for w in self.usable_attention())

    @property
    def can_serve(self) -> bool:
        """Some healthy attention worker has an FFN for its microbatches (a draining one's running work counts)."""
        return any(self.has_ffn(w) for w in self.healthy("attention"))

    def has_ffn(self, worker: Worker) -> bool:
        """Whether `worker`'s microbatches have an FFN to go to: its own (colocated), or a healthy FFN worker
        (a draining one too: what is running finishes)."""
        return runs_own_ffn(worker.assignment) or bool(self.healthy("ffn"))

    def drained(self, worker: Worker, in_flight: Callable[[str], bool]) -> bool:
        """A draining worker may stop: nothing is in flight through it (`in_flight(worker_id)`) and nothing
        more will be. An attention worker: its lane is empty. An FFN worker: another takes the microbatches
        from now on, or no split request is left to send any (`next_ffn` falls back to draining ones)."""
        if in_flight(worker.worker_id):
            return False
        if worker.role == "attention":
            return worker.drained
        return bool(self.serving("ffn")) or all(
            w.drained or runs_own_ffn(w.assignment) for w in self.workers.values() if w.role == "attention")

    def ffn_for(self, worker: Worker) -> Worker | None:
        """The FFN worker of `worker`'s next microbatch: itself when it is colocated, else `next_ffn`."""
        return worker if runs_own_ffn(worker.assignment) else self.next_ffn(worker.pool)

    def attention_per_ffn(self) -> int:
        """Serving attention workers per serving FFN worker (each FFN worker serves about this many): how aflex
        prices a split pool's iteration."""
        n_attention, n_ffn = len(self.serving("attention")), len(self.serving("ffn"))
        return max(1, -(-n_attention // max(1, n_ffn)))

    def context_limit(self) -> int:
        return max((w.capacity_tokens for w in self.usable_attention()), default=0)

    def attention_fits(self, tokens: int) -> list[Worker]:
        """The usable attention workers able to hold `tokens`, best first: the most free KV blocks (estimated),
        then the fewest requests; a decode worker of a P/D plan only when no other fits (it then prefills too).
        `Placement.route` queues a request on the first, or where its prompt's longest cached prefix is."""
        fits = [w for w in self.usable_attention() if w.capacity_tokens >= tokens]
        fits = [w for w in fits if not decodes_only(w.assignment)] or fits
        return sorted(fits, key=lambda w: (w.lane.est_free_blocks, -len(w.lane.running) - len(w.lane.waiting)),
                      reverse=True)

    def next_ffn(self, pool: str = "") -> Worker | None:
        """Round-robin over the serving FFN workers of `pool` (of any pool when it has none; every healthy one
        if all are parked), one turn per microbatch."""
        serving = self.serving("ffn")
        ffn = [w for w in serving if pool and w.pool == pool] or serving or self.healthy("ffn")
        if not ffn:
            return None
        worker = ffn[self._ffn_turn % len(ffn)]
        self._ffn_turn += 1
        return worker

"""The scheduler on a real nats-server, with fake attention/FFN workers that script their tokens.

A fake attention worker answers every descriptor with a `MicrobatchDone`; a sampled token is
100 + the number of tokens that sequence has generated so far (it learns that count from
`generated_ids` on a first pass, as a real worker's sampler does), unless a test scripts it.
Pure unit tests of passes.py come first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.scheduler.main import run
from services.scheduler.model_info import ModelInfo
from services.scheduler.passes import Pass, plan_passes
from services.scheduler.state import RequestState
from shared import subjects
from shared.messages import (
    CancelRequest,
    Heartbeat,
    MicrobatchDescriptor,
    MicrobatchDone,
    OutputDelta,
    Register,
    RegisterReply,
    SamplingSpec,
    SchedulerStatus,
    SchedulerTelemetry,
    SeqResult,
    SubmitReply,
    SubmitRequest,
    decode,
    encode,
)
from shared.policy import BatchingRule
from shared.policy.iteration import IterationPolicy, KvRoom, PrefillQuery, microbatch_depth, parse_depth
from shared.settings import SchedulerSettings

MODEL = ModelInfo("test-model", frozenset({2}), vocab_size=1000, max_seq_len=4096)
EOS = 2


# -- passes (pure) --------------------------------------------------------------------------------


def _state(rid: str, prompt_len: int, *, computed: int = 0, output: int = 0) -> RequestState:
    s = RequestState(rid, list(range(10, 10 + prompt_len)), SamplingSpec(max_tokens=50), 0.0)
    s.output_ids = [100 + i for i in range(output)]
    s.num_computed = computed
    return s


def plan_iteration(running: list[RequestState], waiting: list[RequestState], *, max_batch_tokens: int,
                   max_num_seqs: int, kv: KvRoom[RequestState] | None = None, rule: BatchingRule | None = None,
                   now: float = 0.0, prefill_cap: Callable[[PrefillQuery], int] | None = None,
                   ) -> tuple[list[Pass], list[RequestState]]:
    """The scheduler's planning call (passes.plan_passes), as (passes, admitted)."""
    plan = plan_passes(running, waiting, IterationPolicy(max_batch_tokens, max_num_seqs, rule, now, prefill_cap), kv)
    return plan.passes, plan.admitted


def test_plan_running_first_then_chunked_admission() -> None:
    decoding = _state("d", 5, computed=6, output=2)  # one token to feed
    waiting = [_state("w1", 10), _state("w2", 10)]
    passes, admitted = plan_iteration([decoding], waiting, max_batch_tokens=8, max_num_seqs=10)
    assert [(p.state.request_id, p.n_new) for p in passes] == [("d", 1), ("w1", 7)]
    assert admitted == [waiting[0]]
    assert passes[0].samples and passes[0].is_decode and not passes[1].samples
    work = passes[1].seq_work()
    assert work.start_pos == 0 and work.token_ids == list(range(10, 17)) and work.sampling is not None


def test_plan_respects_max_num_seqs_and_can_admit() -> None:
    running = [_state("r", 3, computed=3, output=1)]
    waiting = [_state("w1", 2), _state("w2", 2)]
    _, admitted = plan_iteration(running, waiting, max_batch_tokens=100, max_num_seqs=2)
    assert [s.request_id for s in admitted] == ["w1"]
    _, admitted = plan_iteration(running, waiting, max_batch_tokens=100, max_num_seqs=9,
                                 kv=KvRoom(free_blocks=0, block_size=16))
    assert admitted == []


def test_recompute_feeds_prompt_and_output_with_generated_ids() -> None:
    s = _state("x", 3, output=2)
    (p,), _ = plan_iteration([], [s], max_batch_tokens=100, max_num_seqs=4)
    work = p.seq_work()
    assert work.token_ids == [10, 11, 12, 100, 101] and work.sample and work.generated_ids == [100, 101]
    s.first_pass_sent = True
    assert Pass.of(s, 5).seq_work().sampling is None


def test_depth_and_split() -> None:
    assert microbatch_depth("auto", 3) == 1 and microbatch_depth("auto", 4) == 2
    assert microbatch_depth("auto", 16, planned=2, overlaps=False) == 1  # a colocated worker: nothing overlaps
    assert microbatch_depth(2, 16, overlaps=False) == 2  # a fixed setting stands
    assert microbatch_depth(3, 2) == 2 and microbatch_depth(4, 10) == 4
    decoding = [_state(f"s{i}", 1, computed=1, output=1) for i in range(3)]
    prompt = _state("p", 100)

    def groups(depth: str, planned: dict[str, int] | None = None) -> list[list[str]]:
        policy = IterationPolicy(1000, 16, depth=parse_depth(depth), planned_depth=planned or {})
        return [[p.state.request_id for p in g] for g in plan_passes(decoding, [prompt], policy).groups]
    assert groups("2") == [["s0", "s1", "s2"], ["p"]]  # 3 tokens | 100 tokens
    assert groups("4") == [["s0"], ["s1"], ["s2"], ["p"]]
    assert groups("auto") == [["s0", "s1", "s2"], ["p"]]  # 4 sequences: 2
    assert groups("auto", {"prefill": 1}) == [["s0", "s1", "s2", "p"]]  # the clock plan's depth for the phase
    assert groups("auto", {"decode": 3}) == [["s0", "s1", "s2"], ["p"]]  # (a plan for the other phase: unused)
    even = [_state(f"e{i}", 1, computed=1, output=1) for i in range(6)]
    plan = plan_passes(even, [], IterationPolicy(1000, 16, depth=3))
    assert [len(g) for g in plan.groups] == [2, 2, 2] and plan.phase == "decode"
    assert plan_passes([], [], IterationPolicy(1000, 16, depth=2)).groups == []
    assert plan_passes([], [_state("q", 8)], IterationPolicy(1000, 16)).phase == "prefill"
    assert plan_passes(even, [_state("q", 8)], IterationPolicy(1000, 16)).phase == "mixed"


# -- fake workers ---------------------------------------------------------------------------------


def default_token(seq_id: str, n: int) -> int:
    return 100 + n


@dataclass
class FakeAttention:
    nc: Client
    worker_id: str
    kv_total_blocks: int = 1000
    block_size: int = 16
    delay_s: float = 0.0
    token: Callable[[str, int], int] = default_token
    descriptors: list[MicrobatchDescriptor] = field(default_factory=list)
    generated: dict[str, int] = field(default_factory=dict)
    fail_at: dict[str, int] = field(default_factory=dict)  # seq -> refuse the pass that would sample token #n
    hold: bool = False  # stop answering descriptors
    drop: int = 0  # lose this many descriptors with sequences, as if NATS had (the worker never sees them)
    report_active: bool = False  # heartbeats list the microbatches in flight, as real attention workers do
    dropped: list[str] = field(default_factory=list)
    active: set[str] = field(default_factory=set)
    _hb: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.nc.subscribe(subjects.attn_mb(self.worker_id), cb=self._on_mb)
        reg = Register(worker_id=self.worker_id, role="attention", model_id="test-model", n_layers=2,
                       kv_total_blocks=self.kv_total_blocks, block_size=self.block_size, max_seq_len=4096)
        reply = decode(RegisterReply, (await self.nc.request(subjects.CONTROL_REGISTER, encode(reg), 5)).data)
        assert reply.ok
        self._hb = asyncio.create_task(heartbeat(self.nc, self.worker_id, "attention", self.kv_total_blocks,
                                                 (lambda: sorted(self.active)) if self.report_active else None))

    def stop_heartbeat(self) -> None:
        if self._hb:
            self._hb.cancel()

    def resume_heartbeat(self) -> None:
        """Heard from again without having restarted (a paused process let go): its KV as it was."""
        self._hb = asyncio.create_task(heartbeat(self.nc, self.worker_id, "attention", self.kv_total_blocks))

    async def _on_mb(self, msg: Msg) -> None:
        desc = decode(MicrobatchDescriptor, msg.data)
        if desc.seqs and self.drop > 0:
            self.drop -= 1
            self.dropped.append(desc.mb_id)
            return
        self.descriptors.append(desc)
        if self.hold:
            return
        for rid in desc.release:
            self.generated.pop(rid, None)
        if not desc.seqs:
            return
        self.active.add(desc.mb_id)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        self.active.discard(desc.mb_id)
        if self.hold:
            return
        results, failed = [], []
        for seq in desc.seqs:
            if seq.sampling is not None:
                self.generated[seq.seq_id] = len(seq.generated_ids)
            n = self.generated.get(seq.seq_id, 0)
            if seq.sample and self.fail_at.get(seq.seq_id) == n:
                del self.fail_at[seq.seq_id]
                failed.append(seq.seq_id)
                continue
            token = None
            if seq.sample:
                token = self.token(seq.seq_id, n)
                self.generated[seq.seq_id] = n + 1
            results.append(SeqResult(seq_id=seq.seq_id, token_id=token))
        done = MicrobatchDone(mb_id=desc.mb_id, worker_id=self.worker_id, results=results,
                              kv_free_blocks=self.kv_total_blocks - 10 * len(self.generated),
                              kv_total_blocks=self.kv_total_blocks, failed_seq_ids=failed)
        await self.nc.publish(subjects.SCHED_DONE, encode(done))

    def seqs_of(self, rid: str) -> list[tuple[MicrobatchDescriptor, int]]:
        return [(d, i) for d in self.descriptors for i, s in enumerate(d.seqs) if s.seq_id == rid]


async def heartbeat(nc: Client, wid: str, role: str, kv_total: int,
                    active: Callable[[], list[str]] | None = None) -> None:
    while True:
        hb = Heartbeat(worker_id=wid, role=role, ts=time.time(), kv_free_blocks=kv_total,  # type: ignore[arg-type]
                       kv_total_blocks=kv_total, active_mb_ids=active() if active is not None else None)
        await nc.publish(subjects.heartbeat(wid), encode(hb))
        await asyncio.sleep(0.1)


async def start_ffn(nc: Client, wid: str) -> asyncio.Task[None]:
    reg = Register(worker_id=wid, role="ffn", model_id="test-model", n_layers=2)
    assert decode(RegisterReply, (await nc.request(subjects.CONTROL_REGISTER, encode(reg), 5)).data).ok
    return asyncio.create_task(heartbeat(nc, wid, "ffn", 0))


# -- harness --------------------------------------------------------------------------------------


@dataclass
class Mesh:
    nc: Client
    attn: dict[str, FakeAttention]
    ffn_tasks: list[asyncio.Task[None]]

    async def status(self) -> SchedulerStatus:
        return decode(SchedulerStatus, (await self.nc.request(subjects.SCHED_STATUS, b"", 2)).data)

    async def submit(self, rid: str, prompt: list[int], **sampling: object) -> SubmitReply:
        req = SubmitRequest(request_id=rid, model="test-model", prompt_ids=prompt,
                            sampling=SamplingSpec(**sampling), arrival_ts=time.time())  # type: ignore[arg-type]
        return decode(SubmitReply, (await self.nc.request(subjects.REQ_SUBMIT, encode(req), 5)).data)

    async def stream(self, rid: str) -> asyncio.Queue[OutputDelta]:
        queue: asyncio.Queue[OutputDelta] = asyncio.Queue()

        async def cb(msg: Msg) -> None:
            await queue.put(decode(OutputDelta, msg.data))

        await self.nc.subscribe(subjects.req_out(rid), cb=cb)
        return queue

    async def run_request(self, rid: str, prompt: list[int], **sampling: object) -> list[OutputDelta]:
        queue = await self.stream(rid)
        reply = await self.submit(rid, prompt, **sampling)
        assert reply.accepted, reply
        return await collect(queue)


async def collect(queue: asyncio.Queue[OutputDelta], timeout_s: float = 5.0) -> list[OutputDelta]:
    deltas: list[OutputDelta] = []
    while not deltas or deltas[-1].finish_reason is None:
        deltas.append(await asyncio.wait_for(queue.get(), timeout_s))
    return deltas


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def mesh(url: str, attn: tuple[FakeAttention | str, ...] = ("a0",), ffn: tuple[str, ...] = ("f0",),
               **settings: object) -> AsyncIterator[Mesh]:
    stop = asyncio.Event()
    settings = {"drain_timeout_s": 0.0, **settings}  # stopped at the end of a test: held requests are dropped
    task = asyncio.create_task(run(SchedulerSettings(nats_url=url, **settings), stop=stop,  # type: ignore[arg-type]
                                   model=MODEL))
    nc = await nats.connect(url)
    m = Mesh(nc, {}, [])
    try:
        deadline = time.monotonic() + 5
        while True:  # the scheduler is up once it answers status
            try:
                await m.status()
                break
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
        for a in attn:
            worker = a if isinstance(a, FakeAttention) else FakeAttention(nc, a)
            worker.nc = nc
            await worker.start()
            m.attn[worker.worker_id] = worker
        for f in ffn:
            m.ffn_tasks.append(await start_ffn(nc, f))
        yield m
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        for worker in m.attn.values():
            worker.stop_heartbeat()
        for t in m.ffn_tasks:
            t.cancel()
        await nc.close()


def tokens(deltas: list[OutputDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


# -- integration ----------------------------------------------------------------------------------


def test_stream_in_order_with_usage_and_length(nats_url: str) -> None:
    async def main() -> None:
        async with mesh(nats_url) as m:
            deltas = await m.run_request("r1", [5, 6, 7], max_tokens=4)
            assert [d.index for d in deltas] == [0, 1, 2, 3]
            assert tokens(deltas) == [100, 101, 102, 103]
            assert deltas[-1].finish_reason == "length"
            assert deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == 4
            assert deltas[-1].usage.prompt_tokens == 3 and deltas[-1].usage.total_tokens == 7
            passes = [d.seqs[i] for d, i in m.attn["a0"].seqs_of("r1")]
            assert [(p.start_pos, p.token_ids) for p in passes] == [(0, [5, 6, 7]), (3, [100]), (4, [101]),
                                                                    (5, [102])]
            assert passes[0].sampling is not None and all(p.sampling is None for p in passes[1:])
            await wait_for(lambda: any("r1" in d.release for d in m.attn["a0"].descriptors))
    asyncio.run(main())


def test_stop_eos_min_tokens_ignore_eos(nats_url: str) -> None:
    def token(seq_id: str, n: int) -> int:
        return EOS if seq_id.startswith("eos") and n == 1 else 100 + n

    async def main() -> None:
        async with mesh(nats_url, attn=(FakeAttention(None, "a0", token=token),)) as m:  # type: ignore[arg-type]
            stop = await m.run_request("stop", [5], max_tokens=10, stop_token_ids=[102])
            assert tokens(stop) == [100, 101, 102] and stop[-1].finish_reason == "stop"
            early = await m.run_request("early", [5], max_tokens=5, stop_token_ids=[101], min_tokens=3)
            assert tokens(early) == [100, 101, 102, 103, 104] and early[-1].finish_reason == "length"
            eos = await m.run_request("eos1", [5], max_tokens=10)
            assert tokens(eos) == [100, EOS] and eos[-1].finish_reason == "stop"
            ignored = await m.run_request("eos2", [5], max_tokens=4, ignore_eos=True)
            assert tokens(ignored) == [100, EOS, 102, 103] and ignored[-1].finish_reason == "length"
    asyncio.run(main())


def test_prefill_is_chunked_to_the_token_budget(nats_url: str) -> None:
    async def main() -> None:
        async with mesh(nats_url, max_batch_tokens=8) as m:
            deltas = await m.run_request("long", list(range(1, 21)), max_tokens=2)
            assert tokens(deltas) == [100, 101]
            passes = [d.seqs[i] for d, i in m.attn["a0"].seqs_of("long")]
            assert [(p.start_pos, len(p.token_ids), p.sample) for p in passes] == [
                (0, 8, False), (8, 8, False), (16, 4, True), (20, 1, True)]
    asyncio.run(main())


def test_depth_two_splits_and_ffn_round_robin(nats_url: str) -> None:
    async def main() -> None:
        attn = FakeAttention(None, "a0", delay_s=0.02)  # type: ignore[arg-type]
        async with mesh(nats_url, attn=(attn,), ffn=("f0", "f1"), microbatch_depth="2") as m:
            q1, q2 = await m.stream("d1"), await m.stream("d2")
            assert (await m.submit("d1", [1, 2, 3], max_tokens=6)).accepted
            assert (await m.submit("d2", [4, 5, 6], max_tokens=6)).accepted
            d1, d2 = await collect(q1), await collect(q2)
            assert tokens(d1) == tokens(d2) == [100, 101, 102, 103, 104, 105]
            by_iter: dict[int, list[MicrobatchDescriptor]] = {}
            for d in attn.descriptors:
                if d.seqs:
                    by_iter.setdefault(d.iteration, []).append(d)
            split = [ds for ds in by_iter.values() if len(ds) == 2]
            assert split, "no iteration was split into two microbatches"
            assert all(len(d.seqs) == 1 for ds in split for d in ds)
            assert len({d.mb_id for d in attn.descriptors}) == len(attn.descriptors)
            assert {d.ffn_worker for d in attn.descriptors if d.seqs} == {"f0", "f1"}
    asyncio.run(main())


def test_queue_full_is_overloaded(nats_url: str) -> None:
    async def main() -> None:
        attn = FakeAttention(None, "a0", hold=True)  # type: ignore[arg-type]
        async with mesh(nats_url, attn=(attn,), max_queue=2, max_num_seqs=1, telemetry_hz=20) as m:
            telemetry: list[SchedulerTelemetry] = []

            async def on_telemetry(msg: Msg) -> None:
                telemetry.append(decode(SchedulerTelemetry, msg.data))

            await m.nc.subscribe(subjects.telemetry("scheduler", "scheduler-0"), cb=on_telemetry)
            for rid in ("q1", "q2", "q3"):
                assert (await m.submit(rid, [1, 2], max_tokens=4)).accepted
            await wait_for(lambda: len(attn.descriptors) == 1)  # q1 running, q2 and q3 wait
            # the per-worker gauges' figures (/metrics: aflex_num_requests_waiting{worker}, ..._running)
            await wait_for(lambda: any(t.waiting_by_worker == {"a0": 2} and t.running_by_worker == {"a0": 1}
                                       for t in telemetry))
            reply = await m.submit("q4", [1, 2], max_tokens=4)
            assert not reply.accepted and reply.error is not None
            assert reply.error.type == "overloaded_error" and reply.error.code == "queue_full"
            assert reply.retry_after_s and reply.retry_after_s > 0
            status = await m.status()
            assert status.queue_depth == 2 and status.running == 1
    asyncio.run(main())


def test_invalid_requests_are_rejected_with_a_param(nats_url: str) -> None:
    async def main() -> None:
        attn = FakeAttention(None, "a0", kv_total_blocks=4, block_size=16)  # type: ignore[arg-type]
        async with mesh(nats_url, attn=(attn,)) as m:
            cases: list[tuple[list[int], dict[str, Any], str]] = [
                ([], {}, "prompt"), ([1] * 60, {"max_tokens": 10}, "max_tokens"),
                ([1], {"temperature": 5.0}, "temperature"), ([1], {"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
                ([5000], {}, "prompt")]
            for i, (prompt, sampling, param) in enumerate(cases):
                reply = await m.submit(f"bad{i}", prompt, **sampling)
                assert not reply.accepted and reply.error is not None, reply
                assert reply.error.type == "invalid_request_error" and reply.error.param == param, reply
                assert reply.error.message
            assert "64 tokens" in (await m.submit("x", [1] * 60, max_tokens=10)).error.message  # type: ignore[union-attr]
            dup_q = await m.stream("dup")
            assert (await m.submit("dup", [1], max_tokens=3)).accepted
            again = await m.submit("dup", [1], max_tokens=3)
            assert not again.accepted and again.error is not None and again.error.code == "duplicate_request_id"
            await collect(dup_q)
    asyncio.run(main())


def test_cancel_stops_deltas_and_releases(nats_url: str) -> None:
    async def main() -> None:
        attn = FakeAttention(None, "a0", delay_s=0.02)  # type: ignore[arg-type]
        async with mesh(nats_url, attn=(attn,)) as m:
            queue = await m.stream("c1")
            assert (await m.submit("c1", [1, 2], max_tokens=1000)).accepted
            first = [await asyncio.wait_for(queue.get(), 5) for _ in range(2)]
            assert tokens(first) == [100, 101]
            # a cancel resent for an earlier submission under the same id (its arrival_ts) spares this one
            await m.nc.publish(subjects.req_cancel("c1"), encode(CancelRequest(request_id="c1", arrival_ts=1.0)))
            first += [await asyncio.wait_for(queue.get(), 5) for _ in range(2)]
            assert tokens(first) == [100, 101, 102, 103] and all(d.finish_reason is None for d in first)
            await m.nc.publish(subjects.req_cancel("c1"), encode(CancelRequest(request_id="c1")))
            rest = await collect(queue)
            assert rest[-1].finish_reason == "abort" and rest[-1].token_ids == []
            await wait_for(lambda: any("c1" in d.release for d in attn.descriptors))
            n = len(attn.descriptors)
            await asyncio.sleep(0.2)
            assert queue.empty() and len(attn.descriptors) == n  # nothing more runs or streams
            indexes = [d.index for d in first + rest]
            assert indexes == list(range(len(indexes)))
    asyncio.run(main())


def test_routing_prefers_more_free_kv(nats_url: str) -> None:
    async def main() -> None:
        small = FakeAttention(None, "small", kv_total_blocks=100)  # type: ignore[arg-type]
        big = FakeAttention(None, "big", kv_total_blocks=500)  # type: ignore[arg-type]
        async with mesh(nats_url, attn=(small, big)) as m:
            await m.run_request("rt", [1, 2, 3], max_tokens=2)
            assert big.seqs_of("rt") and not small.seqs_of("rt")
    asyncio.run(main())


def test_failed_seq_is_recomputed_and_completes(nats_url: str) -> None:
    async def main() -> None:
        attn = FakeAttention(None, "a0", fail_at={"f1": 2})  # type: ignore[arg-type]
        async with mesh(nats_url, attn=(attn,)) as m:
            deltas = await m.run_request("f1", [7, 8], max_tokens=5)
            assert tokens(deltas) == [100, 101, 102, 103, 104] and deltas[-1].finish_reason == "length"
            assert [d.index for d in deltas] == list(range(5))
            passes = attn.seqs_of("f1")
            rerun = [(d, d.seqs[i]) for d, i in passes if d.seqs[i].sampling is not None]
            assert len(rerun) == 2  # the first pass, and the recomputation
            desc, work = rerun[1]
            assert work.start_pos == 0 and work.token_ids == [7, 8, 100, 101] and work.generated_ids == [100, 101]
            assert "f1" in desc.release  # the failed sequence's KV is freed before it is rebuilt
    asyncio.run(main())


def test_status_ready_once_both_roles_registered(nats_url: str) -> None:
    async def main() -> None:
        async with mesh(nats_url, attn=(), ffn=()) as m:
            assert not (await m.status()).ready
            reply = await m.submit("early", [1], max_tokens=2)
            assert not reply.accepted and reply.error is not None and reply.error.code == "no_workers_ready"
            assert reply.retry_after_s
            worker = FakeAttention(m.nc, "a0")
            await worker.start()
            m.attn["a0"] = worker
            assert not (await m.status()).ready
            m.ffn_tasks.append(await start_ffn(m.nc, "f0"))
            status = await m.status()
            assert status.ready and {w.worker_id for w in status.workers} == {"a0", "f0"}
            assert status.model_id == "test-model"
    asyncio.run(main())


def test_lost_attention_worker_requests_finish_elsewhere(nats_url: str) -> None:
    async def main() -> None:
        a0 = FakeAttention(None, "a0", kv_total_blocks=900, delay_s=0.02)  # type: ignore[arg-type]
        a1 = FakeAttention(None, "a1", kv_total_blocks=300)  # type: ignore[arg-type]
        async with mesh(nats_url, attn=(a0, a1), heartbeat_timeout_s=0.4) as m:
            queue = await m.stream("h1")
            assert (await m.submit("h1", [1, 2, 3], max_tokens=8)).accepted
            first = [await asyncio.wait_for(queue.get(), 5) for _ in range(3)]
            a0.hold = True  # a0 dies: no answers, no heartbeats
            a0.stop_heartbeat()
            rest = await collect(queue)
            assert tokens(first + rest) == [100 + i for i in range(8)]
            assert [d.index for d in first + rest] == list(range(8))
            moved = [d.seqs[i] for d, i in a1.seqs_of("h1")]
            assert moved[0].start_pos == 0 and moved[0].sampling is not None and moved[0].generated_ids
            status = await m.status()
            assert {w.worker_id: w.healthy for w in status.workers}["a0"] is False
    asyncio.run(main())


def test_a_paused_worker_back_frees_what_it_ran_before_it_runs_it_again(nats_url: str) -> None:
    """A worker silent past `heartbeat_timeout_s` mid-microbatch (SIGSTOP, found by the fault campaign) is
    taken for lost; its sequences are taken back. Heard from again, not restarted, it still holds their KV:
    it must be told to release them before any runs there again from start_pos 0 (else it refuses them,
    `start_pos_mismatch`, and each refusal counts toward the request's failure limit)."""
    async def main() -> None:
        a0 = FakeAttention(None, "a0", delay_s=0.02)  # type: ignore[arg-type]
        async with mesh(nats_url, attn=(a0,), heartbeat_timeout_s=0.4) as m:
            queue = await m.stream("h1")
            assert (await m.submit("h1", [1, 2, 3], max_tokens=8)).accepted
            first = [await asyncio.wait_for(queue.get(), 5) for _ in range(3)]
            a0.hold = True  # paused: no answers, no heartbeats
            a0.stop_heartbeat()
            deadline = time.monotonic() + 5
            while {w.worker_id: w.healthy for w in (await m.status()).workers}["a0"]:  # until taken for lost
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            paused_at = len(a0.descriptors)
            a0.hold = False
            a0.resume_heartbeat()
            rest = await collect(queue)
            assert tokens(first + rest) == [100 + i for i in range(8)]
            after = a0.descriptors[paused_at:]
            fed_again = next(i for i, d in enumerate(after) if any(s.seq_id == "h1" and s.start_pos == 0
                                                                    for s in d.seqs))
            assert any("h1" in d.release for d in after[:fed_again + 1]), [(d.release, d.seqs) for d in after]
    asyncio.run(main())


def test_a_lost_descriptor_is_found_from_heartbeats(nats_url: str) -> None:
    """A descriptor NATS lost (the worker never got it) is failed as soon as the worker's heartbeats
    show it does not have it, and its sequence runs again: not after `microbatch_timeout_s` (120 s;
    `collect` waits 5 s per delta). A slow microbatch the heartbeats list is left alone."""
    async def main() -> None:
        a0 = FakeAttention(None, "a0", drop=1, report_active=True)  # type: ignore[arg-type]
        async with mesh(nats_url, attn=(a0,), microbatch_lost_after_s=0.3) as m:
            deltas = await m.run_request("r1", [1, 2, 3], max_tokens=4)
            assert tokens(deltas) == [100, 101, 102, 103]
            assert len(a0.dropped) == 1 and a0.descriptors[0].seqs[0].seq_id == "r1"
            a0.delay_s = 1.5  # listed as active for 1.5 s: longer than the 0.3 s grace, not lost
            deltas = await m.run_request("r2", [1, 2, 3], max_tokens=2)
            assert tokens(deltas) == [100, 101]
            assert len(a0.dropped) == 1 and len(a0.seqs_of("r2")) == 2  # each pass sent once
    asyncio.run(main())

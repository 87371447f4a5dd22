"""The attention worker: runs microbatches through every layer, ping-ponging with an FFN worker.

Descriptors come on NATS (`attn.<wid>.mb`), the seam tensors go through the worker's seam
(`ffn_hops.py`). Each descriptor is its own asyncio task, computing inline and awaiting the FFN's
reply per layer: those awaits are where microbatches interleave (the A/F pipeline). Every
descriptor gets exactly one `MicrobatchDone`, with the energy of its attention and FFN work.
In full: docs/architecture.md, "Inside the attention worker".
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from contextlib import AsyncExitStack

from nats.aio.client import Client
from nats.aio.msg import Msg

from services.attention_worker.done_report import Failures, MicrobatchTiming, microbatch_done, undecodable
from services.attention_worker.ffn_hops import FFN_FAILED, FFNHops, FFNReplyError
from services.attention_worker.follower import LOAD, RELEASE, follow
from services.attention_worker.forward import commit, forward
from services.attention_worker.halves import Halves, load_halves
from services.attention_worker.kv_handoff import KVHandoffs, adopt
from services.attention_worker.kv_heads import GroupKV
from services.attention_worker.local_ffn import FFNPath, LocalFFN
from services.attention_worker.microbatch_book import MicrobatchBook, MicrobatchEntry
from services.attention_worker.sequences import Admitted, SequenceRefused, SequenceTable
from services.worker_base.gpu import WorkerGPU
from services.worker_base.loading import eos_token_ids
from services.worker_base.parking import ColdParking
from services.worker_base.presence import Presence, RoleFollower, registration
from services.worker_base.rank_group import GroupLeader, group_devices, group_energy_j
from shared import subjects
from shared.error_types import ErrorType
from shared.errors import AFlexError
from shared.gpu.base import GPU
from shared.lifecycle import stop_on_signals
from shared.messages import (
    Heartbeat,
    KVHandoff,
    MicrobatchDescriptor,
    MicrobatchDone,
    ProtocolError,
    SeqResult,
    decode,
    encode,
)
from shared.model.attention import AttentionHalf, PagedKVStore
from shared.model.ffn import FFNHalf
from shared.model.kv_cache import BlockAllocator, BlockTables
from shared.settings import AttentionWorkerSettings
from shared.transport import bus
from shared.transport.device_group import GroupError
from shared.transport.seam import Frame, Seam
from shared.transport.seam_factory import make_seam

log = logging.getLogger("aflex.attention_worker")

SHUTDOWN_GRACE_S = 10.0  # how long a stopping worker lets in-flight microbatches finish


class AttentionWorker:
    def __init__(self, settings: AttentionWorkerSettings, *, ffn_reply_timeout_s: float | None = None,
                 gpu: GPU | None = None) -> None:
        self.settings = settings
        self.worker_id = subjects.check_token(settings.worker_id)
        self.subject = subjects.attn_mb(self.worker_id)
        self.ffn_reply_timeout_s = settings.ffn_reply_timeout_s if ffn_reply_timeout_s is None else ffn_reply_timeout_s
        self.model: AttentionHalf | None = None
        self.ffn: FFNHalf | None = None  # `colocate`: the FFN half too, for microbatches it runs whole here
        self.model_id = ""
        self.kv: PagedKVStore | None = None
        self.sequences: SequenceTable | None = None
        self.nc: Client | None = None
        self.seam: Seam | None = None
        self._accepting = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.book = MicrobatchBook(self.worker_id, self._free_sequence)
        self.hops = FFNHops(self.worker_id, self.ffn_reply_timeout_s, settings.ffn_silence_s)
        self.handoffs = KVHandoffs(self.worker_id, self.ffn_reply_timeout_s)
        self._gpu_arg = gpu  # None: the backend the settings select, built when the worker starts
        self.gpu: WorkerGPU | None = None
        self.parking: ColdParking | None = None
        self.weight_bytes = 0
        self.halves: Halves | None = None
        # rank 0 of a group of devices (--attention-tp): the other ranks follow it (follower.py)
        self.leader = GroupLeader(settings, "attention-worker", settings.group_size) if settings.group_size > 1 \
            else None

    # -- lifecycle ------------------------------------------------------------------------------

    def load(self) -> None:
        """Load the halves (this rank's share in a group) and allocate the KV cache (blocking); a group's other
        ranks load theirs (again, after a cold park: `GroupLeader.reload`)."""
        if self.leader is not None and self.leader.group is not None:
            self.leader.reload(LOAD, self._load_share)
        else:
            self._load_share()

    def _load_share(self) -> None:
        halves = load_halves(self.settings)
        checkpoint, args = halves.checkpoint, halves.model.args
        self.model, self.ffn, self.kv, self.model_id = halves.model, halves.ffn, halves.kv, checkpoint.model_id
        self.weight_bytes = halves.weight_bytes
        tables = BlockTables(BlockAllocator(self.settings.num_kv_blocks, self.settings.block_size))
        self.sequences = SequenceTable(tables, eos_token_ids(checkpoint), args.vocab_size, args.max_seq_len,
                                       checkpoint.tokenizer)
        if self.leader is not None and self.leader.group is not None:
            halves.reduce_over(self.leader.group)
        self.halves = halves

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Serve until `stop` is set (or SIGTERM/SIGINT), then drain: no new work, what is here finishes (up to
        `drain_timeout_s`, `Presence.drain`); then finish in-flight microbatches, unsubscribe, close."""
        stop = stop or asyncio.Event()
        with stop_on_signals(stop):
            if self.leader is not None:  # rank 0 of a group: the others start and load too
                group = await asyncio.to_thread(self.leader.form_with, self._load_share)
                assert self.halves is not None
                self.halves.reduce_over(group)
            elif self.model is None:
                await asyncio.to_thread(self.load)
            gc.freeze()  # see the FFN worker: no full collection walks the model's objects mid-microbatch
            assert self.model is not None and self.sequences is not None
            s, args = self.settings, self.model.args
            async with AsyncExitStack() as stack:  # each step's undo pushed as it starts: they run in reverse
                if self.leader is not None:  # the followers go last, once nothing runs any more
                    stack.push_async_callback(asyncio.to_thread, self.leader.close)
                self.nc = nc = await bus.connect(s.nats_url, name=f"aflex-attention-{self.worker_id}",
                                                 on_disconnect=self._connection_dropped, user=s.nats_user,
                                                 password=s.nats_password)
                stack.callback(log.info, "attention worker %s stopped", self.worker_id)
                stack.push_async_callback(bus.close, nc)
                self.gpu = gpu = WorkerGPU(s, self.worker_id, "attention", self._gpu_arg)
                if self.leader is not None:
                    self.leader.report_to(gpu.meter)
                stack.push_async_callback(gpu.stop)  # resets the clock
                gpu.meter.kv(0, self.sequences.total_blocks)
                self.parking = ColdParking(self.worker_id, gpu.gpu, release=self._release_weights, load=self.load,
                                           idle=self._holds_nothing, weight_bytes=lambda: self.weight_bytes)
                stack.push_async_callback(self.parking.stop)
                await gpu.start(nc)
                roles = RoleFollower(self.worker_id, gpu.meter, self.parking.assigned)
                stack.push_async_callback(roles.stop)
                await roles.start(nc)
                seam = make_seam(s.seam_transport, self.worker_id, nc, self._stray_frame, self.hops.peer_lost,
                                 listen=False, nats_url=s.nats_url, device=s.device, host=s.seam_host)
                stack.push_async_callback(seam.close)
                await seam.start()
                self.seam = self.hops.seam = seam
                if s.seam_transport == "torch":  # P/D handoffs: KV between attention workers over the seam, never
                    # through NATS (a group's KV is split over its ranks by heads: gathered and put whole, kv_heads.py)
                    if self.leader is not None and self.leader.group is not None and self.halves is not None:
                        self.handoffs.group_kv = GroupKV(self.leader.group, self.halves.checkpoint.args)
                    kv_seam = make_seam("torch", self.worker_id, nc, self.handoffs.on_frame, self.handoffs.peer_lost,
                                        listen=True, nats_url=s.nats_url, device=s.device, host=s.seam_host)
                    stack.push_async_callback(kv_seam.close)
                    await kv_seam.start()
                    self.handoffs.seam = kv_seam
                stack.push_async_callback(self.hops.watch.stop)
                await self.hops.watch.start(nc)
                presence = Presence(
                    nc, registration(self.worker_id, "attention", self.model_id, args.n_layers,
                                     kv_total_blocks=self.sequences.total_blocks, block_size=s.block_size,
                                     max_seq_len=args.max_seq_len, gpu=gpu.gpu, seam_address=seam.address,
                                     kv_address=self.handoffs.seam.address if self.handoffs.seam else "",
                                     halves=["attention", "ffn"] if self.ffn is not None else [],
                                     group_devices=group_devices(s, s.group_size)),
                    self._heartbeat, period_s=s.heartbeat_period_s, register_timeout_s=s.register_timeout_s,
                    on_new_scheduler=self._forget_sequences)
                stack.push_async_callback(presence.stop)
                stack.push_async_callback(self._finish_in_flight)
                await nc.subscribe(self.subject, cb=self._on_descriptor_msg)
                await nc.subscribe(subjects.attn_kv(self.worker_id), cb=self._on_handoff_msg)
                await nc.flush()
                self._accepting = True
                if await presence.start(stop):
                    log.info("attention worker %s serving %s on %s", self.worker_id, self.model_id, self.subject)
                    await stop.wait()
                    await presence.drain(s.drain_timeout_s)

    async def _finish_in_flight(self) -> None:
        """Take no more descriptors; let those in flight end (for up to SHUTDOWN_GRACE_S) and send their Dones."""
        self._accepting = False
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=SHUTDOWN_GRACE_S)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)

    def _release_weights(self) -> None:
        """Parked cold and holding nothing: the model and the KV cache go (the empty block tables stay)."""
        self.model = self.kv = self.ffn = None
        if self.leader is not None:
            self.leader.tell(RELEASE)

    def _holds_nothing(self) -> bool:
        return not self._tasks and self.sequences is not None and len(self.sequences) == 0

    def _connection_dropped(self) -> None:
        """Descriptors sent meanwhile may be lost: heartbeats claim none taken until the next one comes."""
        self.book.connection_dropped()
        if self.settings.seam_transport == "nats":
            self.hops.connection_dropped()

    def _heartbeat(self) -> Heartbeat:
        assert self.sequences is not None
        return Heartbeat(worker_id=self.worker_id, role="attention", ts=time.time(),
                         kv_free_blocks=self.sequences.free_blocks, kv_total_blocks=self.sequences.total_blocks,
                         queue_depth=self.book.queue_depth, active_mb_ids=self.book.active_mb_ids(),
                         newest_mb_id=self.book.newest_mb_id,
                         gpu_energy_j=group_energy_j(self.gpu, self.leader))

    # -- dispatch -------------------------------------------------------------------------------

    async def _on_descriptor_msg(self, msg: Msg) -> None:
        try:
            self._on_descriptor(msg.data)
        except Exception:  # a bad message must never take the subscription down
            log.exception("dropped a malformed message on %s", self.subject)

    async def _on_handoff_msg(self, msg: Msg) -> None:
        """A KV handoff to make: its own task (the subscription takes the next at once), one reply."""
        try:
            req = decode(KVHandoff, msg.data)
        except ProtocolError as exc:
            log.warning("dropped a malformed KV handoff: %s", exc)
            return
        task = asyncio.create_task(self._handoff(req, msg), name=f"handoff-{req.handoff_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handoff(self, req: KVHandoff, msg: Msg) -> None:
        if self.parking is not None:
            await self.parking.ensure_loaded_async()
        assert self.sequences is not None and self.kv is not None
        reply = await self.handoffs.send(req, self.sequences, self.kv, self.book.is_busy)
        try:
            await msg.respond(encode(reply))
        except Exception as exc:
            log.error("could not answer KV handoff %s: %s", req.handoff_id, exc)
        await self._exit_if_group_broken(f"the KV gather of handoff {req.handoff_id} failed")

    def _stray_frame(self, frame: Frame) -> None:
        log.warning("dropped a seam frame nobody asked for (from %s, microbatch %s layer %d)", frame.peer.worker_id,
                    frame.header.mb_id, frame.header.layer)

    def _on_descriptor(self, data: bytes) -> None:
        try:
            desc = decode(MicrobatchDescriptor, data)
        except ProtocolError as exc:
            log.warning("%s", exc)
            self._reject_undecodable(data, str(exc))
            return
        self.book.take(desc.mb_id)
        task = asyncio.create_task(self._microbatch(desc), name=f"mb-{desc.mb_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _reject_undecodable(self, data: bytes, reason: str) -> None:
        """An invalid descriptor that still names its mb_id gets a failed Done, so the scheduler moves on."""
        named = undecodable(data, reason)
        if named is None:
            return
        task = asyncio.create_task(self._publish_done(self._done(*named, [])))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- one microbatch -------------------------------------------------------------------------

    def _free_sequence(self, seq_id: str) -> bool:
        assert self.sequences is not None
        return self.sequences.free(seq_id)

    def _forget_sequences(self) -> None:
        """A new scheduler run knows nothing of the old one's sequences: their continuations come from start_pos 0."""
        assert self.sequences is not None
        seq_ids = self.sequences.seq_ids()
        log.info("%s: a new scheduler; freeing the %d sequences of the one before", self.worker_id, len(seq_ids))
        self.book.release(seq_ids)

    async def _microbatch(self, desc: MicrobatchDescriptor) -> None:
        """One descriptor's task: in the book while it runs, then exactly one Done, whatever happened."""
        started = time.perf_counter()
        failures, timing = Failures(), MicrobatchTiming()
        admitted: list[Admitted] = []
        results: list[SeqResult] = []
        entry = self.book.enter(desc)
        try:
            with entry:
                if not self._accepting:
                    raise AFlexError(f"attention worker {self.worker_id} is shutting down")
                if desc.seqs:
                    subjects.check_token(desc.ffn_worker)
                if self.parking is not None and self.parking.released:  # parked cold and sent work: load first
                    await self.parking.ensure_loaded_async()
                entry.start()
                if self.gpu is not None:
                    self.gpu.meter.queue_depth = self.book.queue_depth
                self._admit(desc, entry, admitted, failures)
                if admitted:
                    results = await self._compute(desc, admitted, timing)
        except asyncio.CancelledError:
            results = []
            self._fail_all(desc, admitted, failures, "worker stopped before the microbatch finished")
            raise
        except Exception as exc:
            results = []
            log.warning("microbatch %s failed: %s", desc.mb_id, exc, exc_info=not isinstance(exc, AFlexError))
            if isinstance(exc, FFNReplyError):
                self._fail_all(desc, admitted, failures, str(exc), exc.code, exc.error_type)
            else:
                self._fail_all(desc, admitted, failures, str(exc))
        finally:
            if entry.in_flight:
                self._meter_after(admitted, results)
            timing.total_s = time.perf_counter() - started
            await self._publish_done(self._done(desc.mb_id, failures, results, timing))
            await self._exit_if_group_broken("a step failed")

    async def _exit_if_group_broken(self, what: str) -> None:
        """Rank 0 of a group that broke: what was sent reaches the scheduler, then this process ends (its group is
        started again whole)."""
        if self.leader is not None and self.leader.group is not None and self.leader.group.broken:
            if self.nc is not None:
                await self.nc.flush()
            self.leader.check(GroupError(what))

    def _admit(self, desc: MicrobatchDescriptor, entry: MicrobatchEntry, admitted: list[Admitted],
               failures: Failures) -> None:
        """Admit each sequence into `admitted`, claimed in the book; one busy elsewhere or refused fails alone."""
        assert self.sequences is not None
        for work in desc.seqs:
            if self.book.is_busy(work.seq_id):
                failures.add(work.seq_id, ErrorType.SERVER_ERROR, "sequence_busy",
                             f"sequence {work.seq_id} is already in an in-flight microbatch")
                continue
            try:
                if work.kv_from is not None and work.seq_id not in self.sequences:
                    assert self.kv is not None
                    adopt(self.sequences, self.kv, self.handoffs, work)
                admitted.append(self.sequences.admit(work))
            except SequenceRefused as exc:
                failures.add(work.seq_id, exc.error_type, exc.code, str(exc))
                continue
            if admitted[-1].copies and self.kv is not None:  # a shared block, before this pass writes it
                self.kv.copy_blocks(admitted[-1].copies, self.sequences.block_tables.block_size)
            entry.claim(work.seq_id)

    def _meter_after(self, admitted: list[Admitted], results: list[SeqResult]) -> None:
        """The meter once a microbatch has left: queue depth, KV in use, and its tokens when it produced any."""
        assert self.sequences is not None
        if self.gpu is None:
            return
        meter = self.gpu.meter
        meter.queue_depth = self.book.queue_depth
        meter.kv(self.sequences.total_blocks - self.sequences.free_blocks, self.sequences.total_blocks)
        if results:
            meter.done(sum(len(a.work.token_ids) for a in admitted))

    def _fail_all(self, desc: MicrobatchDescriptor, admitted: list[Admitted], failures: Failures,
                  message: str, code: str | None = None, error_type: str = ErrorType.SERVER_ERROR) -> None:
        """Every sequence of the microbatch failed; new ones are forgotten, old ones keep their KV as it was."""
        assert self.sequences is not None
        for item in admitted:
            if item.is_new:
                self.sequences.free(item.work.seq_id)
        failures.all_failed(desc, message, code, error_type)

    async def _compute(self, desc: MicrobatchDescriptor, admitted: list[Admitted], timing: MicrobatchTiming
                       ) -> list[SeqResult]:
        """The microbatch's forward (`forward.py`), committed to its sequences."""
        assert self.model is not None and self.kv is not None and self.gpu is not None
        group = self.leader.group if self.leader is not None else None
        assert self.sequences is not None
        results = commit(admitted, *await forward(self.model, self.kv, self.gpu, self._ffn_path(desc), desc,
                                                  admitted, timing, group, self.sequences.block_tables.block_size))
        assert self.sequences is not None
        self.sequences.name_computed(admitted)  # their K/V are written: full blocks join the prefix cache
        return results

    def _ffn_path(self, desc: MicrobatchDescriptor) -> FFNPath:
        """The seam to the descriptor's FFN worker, or this worker's own FFN half when it names this worker
        (the scheduler assigned it `colocated`)."""
        if desc.ffn_worker != self.worker_id:
            return self.hops
        if self.ffn is None or self.gpu is None:
            raise FFNReplyError(f"microbatch {desc.mb_id} asks attention worker {self.worker_id} to run the FFN "
                                f"itself, but it holds no FFN half (start it with --colocate)", FFN_FAILED)
        return LocalFFN(self.ffn, self.gpu, self.leader.group if self.leader is not None else None)

    def _done(self, mb_id: str, failures: Failures, results: list[SeqResult],
              timing: MicrobatchTiming | None = None) -> MicrobatchDone:
        assert self.sequences is not None
        return microbatch_done(mb_id, self.worker_id, self.sequences.free_blocks, self.sequences.total_blocks,
                               results, failures, timing)

    async def _publish_done(self, done: MicrobatchDone) -> None:
        assert self.nc is not None
        try:
            await self.nc.publish(subjects.SCHED_DONE, encode(done))
        except Exception as exc:
            log.error("could not publish the result of microbatch %s: %s", done.mb_id, exc)


async def run(settings: AttentionWorkerSettings, *, stop: asyncio.Event | None = None) -> None:
    """The `aflex attention-worker` service: serve until `stop` is set or SIGTERM, then drain and exit; a rank > 0
    of a group follows its rank 0 instead (follower.py)."""
    if settings.group_rank > 0:
        await asyncio.to_thread(follow, settings)
        return
    await AttentionWorker(settings).run(stop)

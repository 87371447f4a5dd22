"""The attention worker: runs microbatches through every layer, ping-ponging with an FFN worker.

Descriptors come on NATS (`attn.<wid>.mb`), the seam tensors go through the worker's seam
(`ffn_hops.py`). Each descriptor is its own asyncio task, computing inline and awaiting the FFN's
reply per layer: those awaits are where microbatches interleave (the A/F pipeline). Every
descriptor gets exactly one `MicrobatchDone`, with the energy of its attention and FFN work.
In full: docs/architecture.md, "Inside the attention worker".
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import time
from collections.abc import Sequence

import torch
from nats.aio.client import Client
from nats.aio.msg import Msg
from torch import Tensor

from services.attention_worker.done_report import Failures, microbatch_done, undecodable
from services.attention_worker.ffn_hops import FFNHops, FFNReplyError
from services.attention_worker.logprob_rows import PromptPart, prompt_parts, sampled_logprobs
from services.attention_worker.sequences import Admitted, SequenceRefused, SequenceTable
from services.worker_common import (
    Presence,
    WorkerGPU,
    clock_phase,
    eos_token_ids,
    load_half,
    registration,
    stop_presence,
)
from shared import subjects
from shared.error_types import ErrorType
from shared.errors import AFlexError
from shared.gpu.base import GPU, OperatorWork
from shared.gpu.workload import attention_work, lm_head_work
from shared.lifecycle import stop_on_signals
from shared.messages import (
    Heartbeat,
    MicrobatchDescriptor,
    MicrobatchDone,
    ProtocolError,
    SeqResult,
    TokenLogprob,
    decode,
    encode,
)
from shared.model.attention import AttentionHalf, AttentionMeta, PagedKVStore
from shared.model.kv_cache import BlockAllocator, BlockTables
from shared.model.sampling import sample_next_tokens
from shared.settings import AttentionWorkerSettings
from shared.transport import bus
from shared.transport.seam import Frame, Seam
from shared.transport.seams import make_seam

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
        self.model_id = ""
        self.kv: PagedKVStore | None = None
        self.sequences: SequenceTable | None = None
        self.nc: Client | None = None
        self.seam: Seam | None = None
        self._accepting = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._busy: set[str] = set()  # sequences in an in-flight microbatch
        self._release_later: set[str] = set()  # released while busy: freed when their microbatch ends
        self._active_mbs: set[str] = set()
        self._newest_mb_id: str | None = None  # the newest descriptor taken (heartbeats say it)
        self._taken_mbs: set[str] = set()  # taken, their task not started yet (heartbeats list them as active)
        self.hops = FFNHops(self.worker_id, self.ffn_reply_timeout_s, settings.ffn_silence_s)
        self._gpu_arg = gpu  # None: the backend the settings select, built when the worker starts
        self.gpu: WorkerGPU | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def load(self) -> None:
        """Load the attention half and allocate the KV cache (blocking)."""
        checkpoint, module = load_half(self.settings, AttentionHalf)
        self.model, self.model_id = module, checkpoint.model_id
        n_blocks, block_size = self.settings.num_kv_blocks, self.settings.block_size
        weight = module.embed_tokens.weight
        self.kv = PagedKVStore(module.args, n_blocks * block_size, weight.dtype, weight.device)
        tables = BlockTables(BlockAllocator(n_blocks, block_size))
        self.sequences = SequenceTable(tables, eos_token_ids(checkpoint), module.args.vocab_size,
                                       module.args.max_seq_len, checkpoint.tokenizer)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Serve until `stop` is set (or SIGTERM/SIGINT), then finish in-flight work, unsubscribe, drain."""
        stop = stop or asyncio.Event()
        with stop_on_signals(stop):
            if self.model is None:
                await asyncio.to_thread(self.load)
            gc.freeze()  # see the FFN worker: no full collection walks the model's objects mid-microbatch
            assert self.model is not None and self.sequences is not None
            s = self.settings
            self.nc = nc = await bus.connect(s.nats_url, name=f"aflex-attention-{self.worker_id}",
                                             on_disconnect=self._connection_dropped, user=s.nats_user,
                                             password=s.nats_password)
            heartbeat_task: asyncio.Task[None] | None = None
            seam: Seam | None = None
            gpu: WorkerGPU | None = None
            try:
                self.gpu = gpu = WorkerGPU(s, self.worker_id, "attention", self._gpu_arg)
                gpu.meter.kv(0, self.sequences.total_blocks)
                await gpu.start(nc)
                await self.hops.watch.start(nc)
                seam = make_seam(s.seam_transport, self.worker_id, nc, self._stray_frame, self.hops.peer_lost,
                                 listen=False, nats_url=s.nats_url, device=s.device, host=s.seam_host)
                await seam.start()
                self.seam = self.hops.seam = seam
                await nc.subscribe(self.subject, cb=self._on_descriptor_msg)
                await nc.flush()
                self._accepting = True
                args = self.model.args
                presence = Presence(
                    nc, registration(self.worker_id, "attention", self.model_id, args.n_layers,
                                     kv_total_blocks=self.sequences.total_blocks,
                                     block_size=self.settings.block_size, max_seq_len=args.max_seq_len,
                                     gpu=gpu.gpu, seam_address=seam.address),
                    self._heartbeat, period_s=self.settings.heartbeat_period_s,
                    register_timeout_s=self.settings.register_timeout_s, on_new_scheduler=self._forget_sequences)
                if await presence.register(stop) is not None:
                    heartbeat_task = asyncio.create_task(presence.heartbeat_loop(stop))
                    log.info("attention worker %s serving %s on %s", self.worker_id, self.model_id, self.subject)
                    await stop.wait()
            finally:
                self._accepting = False
                await self._finish_in_flight()
                await stop_presence(heartbeat_task)
                await self.hops.watch.stop()
                if seam is not None:
                    await seam.close()
                if gpu is not None:
                    await gpu.stop()  # resets the clock
                await bus.close(nc)
                log.info("attention worker %s stopped", self.worker_id)

    async def _finish_in_flight(self) -> None:
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=SHUTDOWN_GRACE_S)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)

    def _connection_dropped(self) -> None:
        """Descriptors sent meanwhile may be lost: heartbeats claim none taken until the next one comes."""
        self._newest_mb_id = None
        if self.settings.seam_transport == "nats":
            self.hops.connection_dropped()

    def _heartbeat(self) -> Heartbeat:
        assert self.sequences is not None
        return Heartbeat(worker_id=self.worker_id, role="attention", ts=time.time(),
                         kv_free_blocks=self.sequences.free_blocks, kv_total_blocks=self.sequences.total_blocks,
                         queue_depth=len(self._active_mbs), active_mb_ids=sorted(self._active_mbs | self._taken_mbs),
                         newest_mb_id=self._newest_mb_id)

    # -- dispatch -------------------------------------------------------------------------------

    async def _on_descriptor_msg(self, msg: Msg) -> None:
        try:
            self._on_descriptor(msg.data)
        except Exception:  # a bad message must never take the subscription down
            log.exception("dropped a malformed message on %s", self.subject)

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
        self._newest_mb_id = desc.mb_id
        self._taken_mbs.add(desc.mb_id)
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

    def _forget_sequences(self) -> None:
        """A new scheduler run knows nothing of the old one's sequences: their continuations come from start_pos 0."""
        assert self.sequences is not None
        seq_ids = self.sequences.seq_ids()
        log.info("%s: a new scheduler; freeing the %d sequences of the one before", self.worker_id, len(seq_ids))
        self._release(seq_ids)

    def _release(self, seq_ids: Sequence[str]) -> None:
        assert self.sequences is not None
        for seq_id in seq_ids:
            if seq_id in self._busy:
                self._release_later.add(seq_id)
            elif not self.sequences.free(seq_id):
                log.debug("release of unknown sequence %s ignored", seq_id)

    async def _microbatch(self, desc: MicrobatchDescriptor) -> None:
        assert self.sequences is not None
        started = time.perf_counter()
        failures = Failures()
        admitted: list[Admitted] = []
        results: list[SeqResult] = []
        timing = {"attention_s": 0.0, "ffn_wait_s": 0.0, "ffn_compute_s": 0.0, "attention_energy_j": 0.0,
                  "ffn_energy_j": 0.0}
        claimed: list[str] = []
        owns_mb_id = False
        # released after their forks are admitted (unless fed again here: a restart from 0 comes first)
        forked = ({w.fork_of for w in desc.seqs if w.fork_of is not None} - {w.seq_id for w in desc.seqs}
                  if desc.release else set())
        self._taken_mbs.discard(desc.mb_id)
        try:
            self._release([s for s in desc.release if s not in forked])
            if not self._accepting:
                raise AFlexError(f"attention worker {self.worker_id} is shutting down")
            if desc.mb_id in self._active_mbs:
                raise AFlexError(f"microbatch {desc.mb_id} is already in flight on {self.worker_id}")
            if desc.seqs:
                subjects.check_token(desc.ffn_worker)
            self._active_mbs.add(desc.mb_id)
            owns_mb_id = True
            if self.gpu is not None:
                self.gpu.meter.queue_depth = len(self._active_mbs)
            for work in desc.seqs:
                if work.seq_id in self._busy:
                    failures.add(work.seq_id, ErrorType.SERVER_ERROR, "sequence_busy",
                                 f"sequence {work.seq_id} is already in an in-flight microbatch")
                    continue
                try:
                    admitted.append(self.sequences.admit(work))
                except SequenceRefused as exc:
                    failures.add(work.seq_id, exc.error_type, exc.code, str(exc))
                    continue
                if admitted[-1].copies and self.kv is not None:  # a shared block, before this pass writes it
                    self.kv.copy_blocks(admitted[-1].copies, self.sequences.block_tables.block_size)
                self._busy.add(work.seq_id)
                claimed.append(work.seq_id)
            if admitted:
                results = self._commit(admitted, *await self._compute(desc, admitted, timing))
        except asyncio.CancelledError:
            self._fail_all(desc, admitted, failures, "worker stopped before the microbatch finished")
            results = []
            await self._publish_done(self._done(desc.mb_id, failures, results, timing, started))
            raise
        except Exception as exc:
            log.warning("microbatch %s failed: %s", desc.mb_id, exc, exc_info=not isinstance(exc, AFlexError))
            if isinstance(exc, FFNReplyError):
                self._fail_all(desc, admitted, failures, str(exc), exc.code, exc.error_type)
            else:
                self._fail_all(desc, admitted, failures, str(exc))
            results = []
        finally:
            self._release([s for s in desc.release if s in forked])
            if owns_mb_id:
                self._active_mbs.discard(desc.mb_id)
                if self.gpu is not None:
                    meter = self.gpu.meter
                    meter.queue_depth = len(self._active_mbs)
                    meter.kv(self.sequences.total_blocks - self.sequences.free_blocks, self.sequences.total_blocks)
                    if results:
                        meter.done(sum(len(a.work.token_ids) for a in admitted))
            for seq_id in claimed:
                self._busy.discard(seq_id)
            later = [s for s in claimed if s in self._release_later]
            self._release_later.difference_update(later)
            self._release(later)
        await self._publish_done(self._done(desc.mb_id, failures, results, timing, started))

    def _fail_all(self, desc: MicrobatchDescriptor, admitted: list[Admitted], failures: Failures,
                  message: str, code: str | None = None, error_type: str = ErrorType.SERVER_ERROR) -> None:
        """Every sequence of the microbatch failed; new ones are forgotten, old ones keep their KV as it was."""
        assert self.sequences is not None
        for item in admitted:
            if item.is_new:
                self.sequences.free(item.work.seq_id)
        failures.all_failed(desc, message, code, error_type)

    def _commit(self, admitted: list[Admitted], tokens: list[int], logprobs: list[TokenLogprob | None],
                prompt: dict[int, PromptPart]) -> list[SeqResult]:
        """Advance the sequences' computed counts and record the sampled tokens in their samplers."""
        results = []
        sampled = iter(zip(tokens, logprobs, strict=True))
        for index, item in enumerate(admitted):
            item.state.num_computed = item.end
            token: int | None = None
            logprob: TokenLogprob | None = None
            if item.work.sample:
                token, logprob = next(sampled)
                item.state.sampler.record(token)
            part = prompt.get(index)
            if part is not None:
                item.state.held = part.held
            results.append(SeqResult(seq_id=item.work.seq_id, token_id=token, logprob=logprob,
                                     prompt_logprobs=part.entries if part else [],
                                     prompt_logprobs_start=part.start if part else 0))
        return results

    def _done(self, mb_id: str, failures: Failures, results: list[SeqResult],
              timing: dict[str, float] | None = None, started: float | None = None) -> MicrobatchDone:
        assert self.sequences is not None
        if timing is not None and started is not None:
            timing = {**timing, "total_s": time.perf_counter() - started}
        return microbatch_done(mb_id, self.worker_id, self.sequences.free_blocks, self.sequences.total_blocks,
                               results, failures, timing)

    async def _publish_done(self, done: MicrobatchDone) -> None:
        assert self.nc is not None
        try:
            await self.nc.publish(subjects.SCHED_DONE, encode(done))
        except Exception as exc:
            log.error("could not publish the result of microbatch %s: %s", done.mb_id, exc)

    async def _compute(self, desc: MicrobatchDescriptor, admitted: list[Admitted], timing: dict[str, float]
                       ) -> tuple[list[int], list[TokenLogprob | None], dict[int, PromptPart]]:
        """Embed, every layer's attention with an FFN round trip, then logits, sampling and logprobs.

        Each attention layer and the lm_head run at the phase's clock and are accounted on the GPU
        (modelled time, energy); the FFN replies bring the energy of their share of each forward.
        """
        model, kv, worker_gpu = self.model, self.kv, self.gpu
        assert model is not None and kv is not None and worker_gpu is not None
        gpu, controller, meter = worker_gpu.gpu, worker_gpu.controller, worker_gpu.meter
        phase = clock_phase(desc.phase)
        device = model.embed_tokens.weight.device
        dtype_bytes = model.weight_bytes
        t = time.perf_counter()
        with torch.inference_mode():
            meta = AttentionMeta.build([a.seq_pass for a in admitted], device)
            token_ids = torch.tensor([tok for a in admitted for tok in a.work.token_ids], device=device)
            rope = model.rope(meta.positions)
            residual = model.embed(token_ids)
        timing["attention_s"] += time.perf_counter() - t
        layer_work = attention_work(model.args, meta.n_tokens, [a.end for a in admitted], dtype_bytes=dtype_bytes)
        ffn_out: Tensor | None = None
        block = phase == "decode"  # short waits: on the loop's thread (see the torch seam)
        for layer in range(model.args.n_layers):
            controller.before_microbatch(phase)
            energy0 = gpu.total_energy_j()
            t = time.perf_counter()
            with torch.inference_mode():
                residual, ffn_in = model.attend(layer, residual, ffn_out, rope, meta, kv)
            attend_s = time.perf_counter() - t
            t = time.perf_counter()
            # the layer's accounting runs once ffn_in is on its way, while the FFN works
            account = functools.partial(self._account_attention, phase, layer_work, attend_s, energy0, timing)
            ffn_out, ffn_energy, ffn_compute_s = await self.hops.round_trip(desc, layer, ffn_in, account, block=block)
            wait_s = time.perf_counter() - t
            timing["attention_s"] += attend_s
            timing["ffn_wait_s"] += wait_s
            timing["ffn_compute_s"] += ffn_compute_s
            timing["ffn_energy_j"] += ffn_energy
            log.debug("mb %s layer %d: attention %.2f ms, ffn wait %.2f ms (%d rows)",
                      desc.mb_id, layer, attend_s * 1e3, wait_s * 1e3, meta.n_tokens)
        assert ffn_out is not None
        controller.before_microbatch(phase)
        energy0 = gpu.total_energy_j()
        t = time.perf_counter()
        with torch.inference_mode():
            samplers = [a.state.sampler for a in admitted if a.work.sample]
            tokens: list[int] = []
            logprobs: list[TokenLogprob | None] = []
            if samplers:
                logits = model.logits(residual, ffn_out, meta.logits_rows)
                tokens = sample_next_tokens(logits, samplers)
                logprobs = sampled_logprobs(logits, samplers, tokens)
            prompt = prompt_parts(model, residual, ffn_out, admitted)
        logits_s = time.perf_counter() - t
        if samplers:
            meter.busy(logits_s, gpu.run(lm_head_work(model.args, len(samplers), dtype_bytes=dtype_bytes), logits_s))
        timing["attention_energy_j"] += gpu.total_energy_j() - energy0
        timing["attention_s"] += logits_s
        return tokens, logprobs, prompt

    def _account_attention(self, phase: str, work: OperatorWork, attend_s: float, energy0_j: float,
                           timing: dict[str, float]) -> None:
        """One layer's attention on the GPU's books: modelled time, meter, the microbatch's attention energy."""
        worker_gpu = self.gpu
        assert worker_gpu is not None
        gpu = worker_gpu.gpu
        worker_gpu.meter.op(phase, attend_s, gpu.run(work, attend_s))
        timing["attention_energy_j"] += gpu.total_energy_j() - energy0_j



async def run(settings: AttentionWorkerSettings, *, stop: asyncio.Event | None = None) -> None:
    """The `aflex attention-worker` service: serve until `stop` is set or SIGTERM, then drain and exit."""
    await AttentionWorker(settings).run(stop)

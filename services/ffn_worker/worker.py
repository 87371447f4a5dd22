"""The FFN worker: a stateless server of per-layer FFNs, merging microbatches that wait together.

Frames from any attention worker that queue for the same layer are stacked into one matrix product
(one bigger GEMM instead of several small ones: an FFN worker's throughput), split back by rows and
answered to their senders, each with its share of the forward's energy. What arrives on which thread,
the per-phase clock and the error frames: docs/architecture.md, "Inside the FFN worker".
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from contextlib import AsyncExitStack

import torch
from nats.aio.client import Client
from torch import Tensor

from services.ffn_worker.follower import LOAD, RELEASE, follow, lead_ffn
from services.ffn_worker.serving import ServingQueue, Work
from services.worker_base.ffn_forward import ffn_forward
from services.worker_base.gpu import WorkerGPU
from services.worker_base.loading import load_half, parameter_bytes
from services.worker_base.parking import ColdParking
from services.worker_base.presence import Presence, RoleFollower, registration
from services.worker_base.rank_group import GroupLeader, group_devices, group_energy_j
from shared import subjects
from shared.errors import AFlexError
from shared.gpu.base import GPU
from shared.kinds import ClockPhase
from shared.lifecycle import stop_on_signals
from shared.messages import Heartbeat
from shared.model.config import ModelArgs
from shared.model.ffn import FFNHalf
from shared.settings import FFNWorkerSettings
from shared.transport import bus
from shared.transport.header import SeamHeader, error_payload
from shared.transport.seam import Frame, Peer, Seam
from shared.transport.seam_factory import make_seam

log = logging.getLogger("aflex.ffn_worker")

SHUTDOWN_GRACE_S = 10.0  # how long a stopping worker answers what is queued


class FFNFrameError(AFlexError):
    """A seam frame this worker cannot serve: wrong kind, layer or shape."""


class FFNWorker:
    def __init__(self, settings: FFNWorkerSettings, *, gpu: GPU | None = None) -> None:
        self.settings = settings
        self.worker_id = subjects.check_token(settings.worker_id)
        self.model: FFNHalf | None = None
        self.model_id = ""
        self.nc: Client | None = None
        self.seam: Seam | None = None
        self.queue = ServingQueue(self._serve, merge=settings.merge_microbatches)
        self.forwards = 0  # FFN forward calls made
        self.frames_served = 0  # frames answered with a result (> forwards when merging)
        self._gpu_arg = gpu  # None: the backend the settings select, built when the worker starts
        self.gpu: WorkerGPU | None = None
        self.parking: ColdParking | None = None
        self.args: ModelArgs | None = None  # the model's shape, kept while its weights are released
        self.weight_bytes = 0
        # rank 0 of a group of devices (--ffn-tp, --ffn-ep): the other ranks follow it (follower.py)
        self.leader = GroupLeader(settings, "ffn-worker", settings.group_size) if settings.group_size > 1 else None

    # -- lifecycle ------------------------------------------------------------------------------

    def load(self) -> None:
        """This rank's share of the FFN half (all of it outside a group); a group's other ranks load theirs
        (again, after a cold park: `GroupLeader.reload`)."""
        if self.leader is not None and self.leader.group is not None:
            self.leader.reload(LOAD, self._load_share)
        else:
            self._load_share()

    def _load_share(self) -> None:
        checkpoint, self.model = load_half(self.settings, FFNHalf)
        self.model_id, self.args = checkpoint.model_id, self.model.args
        self.weight_bytes = parameter_bytes(self.model)
        if self.leader is not None and self.leader.group is not None:
            self.model.reduce = self.leader.group.all_reduce

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Serve until `stop` is set (or SIGTERM/SIGINT); then drain (`Presence.drain`: the scheduler sends its
        microbatches elsewhere, or none are left), unsubscribe, serve what is queued, close."""
        stop = stop or asyncio.Event()
        with stop_on_signals(stop):
            if self.leader is not None:  # rank 0 of a group: the others start and load too
                group = await asyncio.to_thread(self.leader.form_with, self._load_share)
                self.model.reduce = group.all_reduce  # type: ignore[union-attr]
            elif self.model is None:
                await asyncio.to_thread(self.load)
            # What exists now (the model, torch, nats) lives as long as the worker: out of the
            # collector's sight, a full collection no longer walks it all in the middle of a hop.
            gc.freeze()
            assert self.model is not None
            s = self.settings
            async with AsyncExitStack() as stack:  # each step's undo pushed as it starts: they run in reverse
                if self.leader is not None:  # the followers go last, once nothing is served any more
                    stack.push_async_callback(asyncio.to_thread, self.leader.close)
                self.nc = nc = await bus.connect(s.nats_url, name=f"aflex-ffn-{self.worker_id}", user=s.nats_user,
                                                 password=s.nats_password)
                stack.callback(log.info, "ffn worker %s stopped", self.worker_id)
                stack.push_async_callback(bus.close, nc)
                self.gpu = gpu = WorkerGPU(s, self.worker_id, "ffn", self._gpu_arg)
                if self.leader is not None:
                    self.leader.report_to(gpu.meter)
                stack.push_async_callback(gpu.stop)  # resets the clock
                stack.callback(self.queue.stop)
                self.parking = ColdParking(self.worker_id, gpu.gpu, release=self._release_weights, load=self.load,
                                           idle=self.queue.idle.is_set, weight_bytes=lambda: self.weight_bytes)
                stack.push_async_callback(self.parking.stop)
                await gpu.start(nc)
                roles = RoleFollower(self.worker_id, gpu.meter, self.parking.assigned)
                stack.push_async_callback(roles.stop)
                await roles.start(nc)
                self.seam = seam = make_seam(s.seam_transport, self.worker_id, nc, self._on_frame, self._peer_lost,
                                             listen=True, nats_url=s.nats_url, device=s.device, host=s.seam_host)
                stack.push_async_callback(self._close_seam, seam)
                await seam.start()
                presence = Presence(nc, registration(self.worker_id, "ffn", self.model_id, self.model.args.n_layers,
                                                     gpu=gpu.gpu, seam_address=seam.address,
                                                     group_devices=group_devices(s, s.group_size)),
                                    self._heartbeat, period_s=s.heartbeat_period_s,
                                    register_timeout_s=s.register_timeout_s)
                stack.push_async_callback(presence.stop)
                if await presence.start(stop):
                    log.info("ffn worker %s serving %s, seam at %s (merge=%s)", self.worker_id, self.model_id,
                             seam.address, s.merge_microbatches)
                    await stop.wait()
                    await presence.drain(s.drain_timeout_s)

    async def _close_seam(self, seam: Seam) -> None:
        """Answer what is queued (for up to SHUTDOWN_GRACE_S), then close the seam."""
        await asyncio.to_thread(self.queue.idle.wait, SHUTDOWN_GRACE_S)
        await seam.close()

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(worker_id=self.worker_id, role="ffn", ts=time.time(), queue_depth=len(self.queue),
                         seam_address=self.seam.address if self.seam is not None else "",
                         gpu_energy_j=group_energy_j(self.gpu, self.leader))

    # -- receiving ------------------------------------------------------------------------------

    def _on_frame(self, frame: Frame) -> None:
        """A seam frame, on the seam's receiving thread: check it and queue it (`ServingQueue` serves)."""
        try:
            work = self._check(frame)
        except Exception as exc:  # never let a bad frame stop the frames after it
            log.warning("ffn worker %s: dropped a frame from %s: %s", self.worker_id, frame.peer.worker_id, exc)
            self._reply_error(frame, str(exc))
            return
        self.queue.put(work)

    def _peer_lost(self, peer: Peer, reason: str) -> None:
        """An attention worker's seam broke: its queued frames have nobody to go back to."""
        self.queue.forget(peer)
        log.info("ffn worker %s: seam from %s closed (%s)", self.worker_id, peer.worker_id, reason)

    def _check(self, frame: Frame) -> Work:
        args = self.args
        assert args is not None
        header, tensor = frame.header, frame.tensor
        if header.kind != "to_ffn":
            raise FFNFrameError(f"frame kind is {header.kind!r}, expected 'to_ffn'")
        if not 0 <= header.layer < args.n_layers:
            raise FFNFrameError(f"layer {header.layer} is not in [0, {args.n_layers})")
        if tensor.dim() != 2 or tensor.shape[1] != args.dim:
            raise FFNFrameError(f"ffn_in must be [tokens, {args.dim}], got {list(tensor.shape)}")
        return Work(frame)

    # -- serving --------------------------------------------------------------------------------

    def _forward(self, batch: list[Work]) -> tuple[list[Tensor], list[float], float]:
        """One FFN forward over the stacked rows of `batch` at the batch's phase clock; the outputs
        split back per frame, with each frame's share (by rows) of the forward's GPU energy."""
        model, worker_gpu = self.model, self.gpu
        assert model is not None and worker_gpu is not None
        phase: ClockPhase = "prefill" if any(w.request.header.phase == "prefill" for w in batch) else "decode"
        rows = [w.hidden.shape[0] for w in batch]
        x = batch[0].hidden if len(batch) == 1 else torch.cat([w.hidden for w in batch])
        group = self.leader.group if self.leader is not None else None
        if group is None:
            out, energy, measured_s = ffn_forward(model, worker_gpu, batch[0].layer, phase, x)
        else:  # every rank's share; the energy is the group's
            out, energy, measured_s = lead_ffn(group, model, worker_gpu, batch[0].layer, phase, x)
        total_rows = sum(rows)
        meter = worker_gpu.meter
        meter.done(total_rows, len(batch))
        meter.queue_depth = len(self.queue)
        self.forwards += 1
        shares = [energy * r / total_rows if total_rows else energy / len(batch) for r in rows]
        dtype = batch[0].hidden.dtype
        if len(batch) == 1 and out.dtype == dtype:
            return [out], shares, measured_s
        return [part.to(dtype) for part in out.split(rows)], shares, measured_s

    def _release_weights(self) -> None:
        """Parked cold with nothing queued: the weights go (the model's shape stays, to check frames), on every
        rank of a group."""
        self.model = None
        if self.leader is not None:
            self.leader.tell(RELEASE)

    def _serve(self, batch: list[Work]) -> None:
        try:
            if self.parking is not None:  # parked cold (weights released) and sent frames anyway: load first
                self.parking.ensure_loaded()
            outputs, energies, compute_s = self._forward(batch)
        except Exception as exc:
            log.exception("ffn worker %s: layer %d forward failed", self.worker_id, batch[0].layer)
            for work in batch:
                self._reply_error(work.request, f"FFN forward failed: {exc}")
            if self.leader is not None:  # a broken group ends this process, to be started again whole
                self.leader.check(exc)
            return
        log.debug("ffn layer %d: %d frame(s), %d rows in one forward (%.2f ms)", batch[0].layer, len(batch),
                  sum(o.shape[0] for o in outputs), compute_s * 1e3)
        for work, out, energy_j in zip(batch, outputs, energies, strict=True):
            asked = work.request.header
            reply = SeamHeader(kind="to_attention", mb_id=asked.mb_id, layer=asked.layer, phase=asked.phase,
                               dtype=out.dtype, shape=tuple(out.shape), energy_j=energy_j, compute_s=compute_s)
            self._send(work.request, reply, out)
            self.frames_served += 1

    def _send(self, request: Frame, header: SeamHeader, tensor: Tensor) -> None:
        """Answer a frame now (not behind the next forward); a lost peer's reply has nowhere to go."""
        seam = self.seam
        assert seam is not None
        try:
            seam.reply(request, header, tensor)
        except Exception as exc:  # the attention side's own watch fails its hop
            log.warning("ffn worker %s: could not reply to %s: %s", self.worker_id, request.peer.worker_id, exc)

    def _reply_error(self, request: Frame, error: str) -> None:
        payload = error_payload(error)
        asked = request.header
        self._send(request, SeamHeader(kind="error", mb_id=asked.mb_id, layer=asked.layer, phase=asked.phase,
                                       dtype=payload.dtype, shape=tuple(payload.shape)), payload)


async def run(settings: FFNWorkerSettings, *, stop: asyncio.Event | None = None) -> None:
    """The `aflex ffn-worker` service: serve until `stop` is set or SIGTERM, then drain and exit; a rank > 0 of a
    group follows its rank 0 instead (follower.py)."""
    if settings.group_rank > 0:
        await asyncio.to_thread(follow, settings)
        return
    await FFNWorker(settings).run(stop)

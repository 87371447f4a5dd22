"""The FFN worker: a stateless server of per-layer FFNs, merging microbatches that wait together.

Seam frames arrive on `ffn.<wid>.mb` through the worker's seam port (`shared/seam_port.py`: the
lean seam link by default), chunks reassembled by `wire.FrameAssembler`, and queue up. Serving
starts right after the socket read that brought them (the seam port's `after_batch`), not in a task
woken by an event: a task's wake-up costs another trip through the event loop on every hop. Each
serving call takes the next frame plus every other queued frame of the same layer, stacks their
rows into one [sum T, D] tensor and runs the layer's FFN once: with several microbatches (or
several attention workers) in flight, one bigger GEMM replaces several small ones, which is where
an FFN worker's throughput comes from. The output is split back by row counts and each part goes
to its frame's `reply_to` with direction "to_attention", the same mb_id and layer.

Before each forward the worker asks its DVFS controller for the clock of the batch's phase (the
frames' header field `phase`; a batch with any prefill frame runs the prefill clock, a frame without
the field counts as decode). The forward is accounted on the GPU (`GPU.run`: modelled time), and the
GPU's energy over it is shared among the merged frames by rows: each reply's header carries its
share as `energy_j`.

A frame that cannot be served (bad layer, bad shape, a failing forward) is answered with an
error frame (header `error`, empty tensor) when it says where to reply, and dropped otherwise.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from nats.aio.client import Client
from torch import Tensor

from services.worker_common import Presence, WorkerGPU, clock_phase, load_half, registration, stop_presence
from shared import bus, subjects, wire
from shared.errors import AFlexError
from shared.gpu.base import GPU
from shared.gpu.workload import ffn_work
from shared.lifecycle import stop_on_signals
from shared.messages import Heartbeat
from shared.model.ffn import FFNHalf
from shared.seam_port import SeamPort, open_seam_port
from shared.settings import FFNWorkerSettings

log = logging.getLogger("aflex.ffn_worker")

_ASSEMBLY_KEY = ("reply_to", "mb_id", "layer", "direction")  # mb_ids of two attention workers may meet here


class SeamFrameError(AFlexError):
    """A seam frame this worker cannot serve: wrong direction, layer, shape or reply subject."""


@dataclass(frozen=True)
class _Work:
    mb_id: str
    layer: int
    reply_to: str
    hidden: Tensor  # [T, D] ffn_in as it arrived
    phase: str = "decode"  # the clock phase of the frame's microbatch


class FFNWorker:
    def __init__(self, settings: FFNWorkerSettings, *, gpu: GPU | None = None) -> None:
        self.settings = settings
        self.worker_id = subjects.check_token(settings.worker_id)
        self.subject = subjects.ffn_mb(self.worker_id)
        self.model: FFNHalf | None = None
        self.model_id = ""
        self.nc: Client | None = None
        self.seam: SeamPort | None = None
        self._queue: deque[_Work] = deque()
        self._serve_scheduled = False  # a `_serve_next` call is on the loop's ready queue
        self._idle = asyncio.Event()  # set while nothing is queued or scheduled
        self._idle.set()
        self._assembler = wire.FrameAssembler()
        self.forwards = 0  # FFN forward calls made
        self.frames_served = 0  # frames answered with a result (> forwards when merging)
        self._gpu_arg = gpu  # None: the backend the settings select, built when the worker starts
        self.gpu: WorkerGPU | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def load(self) -> None:
        s = self.settings
        checkpoint, module = load_half(s.model, "ffn", s.dtype, s.device, s.quantize)
        assert isinstance(module, FFNHalf)
        self.model, self.model_id = module, checkpoint.model_id

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Serve until `stop` is set (or SIGTERM/SIGINT); then unsubscribe, serve what is queued, drain."""
        stop = stop or asyncio.Event()
        with stop_on_signals(stop):
            if self.model is None:
                await asyncio.to_thread(self.load)
            # What exists now (the model, torch, nats) lives as long as the worker: out of the
            # collector's sight, a full collection no longer walks it all in the middle of a hop.
            gc.freeze()
            assert self.model is not None
            self.nc = nc = await bus.connect(self.settings.nats_url, name=f"aflex-ffn-{self.worker_id}")
            self.gpu = gpu = WorkerGPU(self.settings, self.worker_id, "ffn", self._gpu_arg)
            heartbeat_task: asyncio.Task[None] | None = None
            seam: SeamPort | None = None
            try:
                await gpu.start(nc)
                self.seam = seam = await open_seam_port(self.settings.seam_transport, self.settings.nats_url,
                                                        f"aflex-ffn-{self.worker_id}", nc)
                await seam.subscribe(self.subject, self._on_payload, after_batch=self._serve_arrived)
                presence = Presence(nc, registration(self.worker_id, "ffn", self.model_id, self.model.args.n_layers,
                                                     gpu=gpu.gpu),
                                    self._heartbeat, period_s=self.settings.heartbeat_period_s,
                                    register_timeout_s=self.settings.register_timeout_s)
                if await presence.register(stop) is not None:
                    heartbeat_task = asyncio.create_task(presence.heartbeat_loop(stop))
                    log.info("ffn worker %s serving %s on %s (merge=%s)", self.worker_id, self.model_id,
                             self.subject, self.settings.merge_microbatches)
                    await stop.wait()
            finally:
                await stop_presence(heartbeat_task)
                if seam is not None:
                    await seam.stop_receiving()
                    await self._idle.wait()  # answers what is queued
                    await seam.close()
                await gpu.stop()  # resets the clock
                await bus.close(nc)
                log.info("ffn worker %s stopped", self.worker_id)

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(worker_id=self.worker_id, role="ffn", ts=time.time(), queue_depth=len(self._queue))

    # -- receiving ------------------------------------------------------------------------------

    def _on_payload(self, subject: str, payload: bytearray) -> None:
        """A seam frame (or chunk), inside the socket read: check it and queue it (`_serve_arrived` serves)."""
        header: dict[str, Any] = {}
        try:
            got = self._assembler.add(payload, _ASSEMBLY_KEY)
            if got is None:
                return  # more chunks to come
            header, tensor = got
            self._queue.append(self._check(header, tensor))
            self._idle.clear()
        except Exception as exc:  # never let a bad frame take the subscription down
            log.warning("ffn worker %s: dropped a frame on %s: %s", self.worker_id, subject, exc)
            reply_to = header.get("reply_to")
            if isinstance(reply_to, str) and reply_to and isinstance(header.get("mb_id"), str):
                self._reply_error(reply_to, header["mb_id"], header.get("layer"), str(exc))

    def _check(self, header: dict[str, Any], tensor: Tensor) -> _Work:
        assert self.model is not None
        mb_id, layer, reply_to = header.get("mb_id"), header.get("layer"), header.get("reply_to")
        if not isinstance(reply_to, str) or not reply_to or not isinstance(mb_id, str):
            raise SeamFrameError("frame header lacks mb_id or reply_to")
        if header.get("direction") != "to_ffn":
            raise SeamFrameError(f"frame direction is {header.get('direction')!r}, expected 'to_ffn'")
        n_layers = self.model.args.n_layers
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < n_layers:
            raise SeamFrameError(f"layer {layer!r} is not in [0, {n_layers})")
        if tensor.dim() != 2 or tensor.shape[1] != self.model.args.dim:
            raise SeamFrameError(f"ffn_in must be [tokens, {self.model.args.dim}], got {list(tensor.shape)}")
        return _Work(mb_id, layer, reply_to, tensor, clock_phase(header.get("phase", "decode")))

    # -- serving --------------------------------------------------------------------------------

    def _take_batch(self) -> list[_Work]:
        """The oldest frame, plus (when merging) the oldest queued frame of its layer and dtype from
        each *other* attention worker.

        Frames of one attention worker (one `reply_to`) are never merged: they are its pipelined
        microbatches, and answering them together would put them back in lockstep, so that its
        attention and this FFN stop overlapping (measured on SmolLM2 at depth 2: 168 tok/s merged,
        the same as depth 1).
        """
        first = self._queue.popleft()
        batch = [first]
        if self.settings.merge_microbatches and self._queue:
            senders = {first.reply_to}
            rest: deque[_Work] = deque()
            for work in self._queue:
                same = work.layer == first.layer and work.hidden.dtype == first.hidden.dtype
                if same and work.reply_to not in senders:
                    senders.add(work.reply_to)
                    batch.append(work)
                else:
                    rest.append(work)
            self._queue = rest
        return batch

    def _forward(self, batch: list[_Work]) -> tuple[list[Tensor], list[float], float]:
        """One FFN forward over the stacked rows of `batch` at the batch's phase clock; the outputs
        split back per frame, with each frame's share (by rows) of the forward's GPU energy."""
        model, worker_gpu = self.model, self.gpu
        assert model is not None and worker_gpu is not None
        gpu = worker_gpu.gpu
        phase = "prefill" if any(w.phase == "prefill" for w in batch) else "decode"
        rows = [w.hidden.shape[0] for w in batch]
        x = batch[0].hidden if len(batch) == 1 else torch.cat([w.hidden for w in batch])
        worker_gpu.controller.before_microbatch(phase)
        energy0 = gpu.total_energy_j()
        started = time.perf_counter()
        with torch.inference_mode():
            out = model(batch[0].layer, x.to(device=model.device, dtype=model.activation_dtype))
        measured_s = time.perf_counter() - started
        total_rows = sum(rows)
        modelled_s = gpu.run(ffn_work(model.args, total_rows, dtype_bytes=model.weight_bytes, layer=batch[0].layer,
                                       phase=phase), measured_s)
        energy = gpu.total_energy_j() - energy0
        meter = worker_gpu.meter
        meter.op(phase, measured_s, modelled_s)
        meter.done(total_rows, len(batch))
        meter.queue_depth = len(self._queue)
        self.forwards += 1
        shares = [energy * r / total_rows if total_rows else energy / len(batch) for r in rows]
        dtype = batch[0].hidden.dtype
        if len(batch) == 1 and out.dtype == dtype:
            return [out], shares, measured_s
        return [part.to(dtype) for part in out.split(rows)], shares, measured_s

    def _serve_arrived(self) -> None:
        """After a read's frames are queued (so those of one layer from several attention workers merge):
        serve now, unless a serving call is already scheduled."""
        if self._queue and not self._serve_scheduled:
            self._serve_next()

    def _schedule_serving(self) -> None:
        if not self._serve_scheduled:
            self._serve_scheduled = True
            self._idle.clear()
            asyncio.get_running_loop().call_soon(self._serve_next)

    def _serve_next(self) -> None:
        """One forward over the next batch, its replies written; then, if more is queued, again on the
        loop's next turn (so frames that arrive meanwhile are queued, and can merge, first)."""
        self._serve_scheduled = False
        if self._queue:
            self._serve(self._take_batch())
        if self._queue:
            self._schedule_serving()
        else:
            self._idle.set()

    def _serve(self, batch: list[_Work]) -> None:
        try:
            outputs, energies, compute_s = self._forward(batch)
        except Exception as exc:
            log.exception("ffn worker %s: layer %d forward failed", self.worker_id, batch[0].layer)
            for work in batch:
                self._reply_error(work.reply_to, work.mb_id, work.layer, f"FFN forward failed: {exc}")
            return
        log.debug("ffn layer %d: %d frame(s), %d rows in one forward (%.2f ms)", batch[0].layer, len(batch),
                  sum(o.shape[0] for o in outputs), compute_s * 1e3)
        for work, out, energy_j in zip(batch, outputs, energies, strict=True):
            self._reply(work.reply_to, work.mb_id, work.layer, out, energy_j=energy_j, compute_s=compute_s)
            self.frames_served += 1

    def _reply(self, reply_to: str, mb_id: str, layer: Any, tensor: Tensor,
               error: str | None = None, *, energy_j: float = 0.0, compute_s: float = 0.0) -> None:
        """Send a frame's FFN output back, with its energy share and the forward's compute time (so the
        attention side can tell transport time from FFN time)."""
        seam = self.seam
        assert seam is not None
        header: dict[str, Any] = {"mb_id": mb_id, "layer": layer, "direction": "to_attention",
                                  "worker_id": self.worker_id, "energy_j": energy_j, "compute_s": compute_s}
        if error is not None:
            header["error"] = error
        try:
            for frame in wire.encode_frames(header, tensor, seam.max_payload):
                seam.publish(reply_to, frame)  # on the socket now, not behind the next forward
        except Exception as exc:  # a bad reply subject or a lost connection: the attention side times out
            log.warning("ffn worker %s: could not reply to %s: %s", self.worker_id, reply_to, exc)

    def _reply_error(self, reply_to: str, mb_id: str, layer: Any, error: str) -> None:
        self._reply(reply_to, mb_id, layer, torch.empty(0), error)


async def run(settings: FFNWorkerSettings, *, stop: asyncio.Event | None = None) -> None:
    """The `aflex ffn-worker` service: serve until `stop` is set or SIGTERM, then drain and exit."""
    await FFNWorker(settings).run(stop)

"""The attention worker's side of the seam: each layer's ffn_in out to an FFN worker, its ffn_out back.

One `FFNHops` per attention worker keeps every hop in flight, keyed by (microbatch, layer), as a
future that the reply frame resolves (inside the socket read that completed it), or that fails: the
FFN worker answered with an error or a wrong shape, it went silent (`FFNWatch`, from its heartbeats),
the seam's connection dropped, or no reply came within `reply_timeout_s`. A failed hop fails its
microbatch, whose sequences the scheduler recomputes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from torch import Tensor

from services.attention_worker.ffn_watch import FFNWatch
from services.worker_common import clock_phase
from shared import subjects, wire
from shared.errors import AFlexError
from shared.messages import MicrobatchDescriptor
from shared.seam_port import SeamPort

log = logging.getLogger("aflex.attention_worker")


class FFNReplyError(AFlexError):
    """The FFN worker answered a seam frame with an error, a wrong shape, or not at all."""


class FFNHops:
    def __init__(self, worker_id: str, reply_subject: str, reply_timeout_s: float, silence_s: float) -> None:
        self.worker_id, self.subject, self.reply_timeout_s = worker_id, reply_subject, reply_timeout_s
        self.seam: SeamPort | None = None  # set when the worker has opened its seam
        self._replies: dict[tuple[str, int], asyncio.Future[tuple[Tensor, float, float]]] = {}
        self.watch = FFNWatch(silence_s, self._silent)
        self._assembler = wire.FrameAssembler()

    def on_frame(self, data: bytearray) -> None:
        got = self._assembler.add(data)
        if got is None:
            return  # more chunks to come
        header, tensor = got
        key = (header.get("mb_id"), header.get("layer"))
        future = self._replies.get(key)  # type: ignore[arg-type]
        if header.get("direction") != "to_attention" or future is None or future.done():
            log.debug("dropped a seam frame nobody waits for: mb %s layer %s", *key)
            return
        if header.get("error"):
            future.set_exception(FFNReplyError(f"FFN worker {header.get('worker_id')} failed layer "
                                               f"{key[1]} of microbatch {key[0]}: {header['error']}"))
        else:
            energy, compute = header.get("energy_j"), header.get("compute_s")
            future.set_result((tensor, float(energy) if isinstance(energy, int | float) else 0.0,
                               float(compute) if isinstance(compute, int | float) else 0.0))

    async def round_trip(self, desc: MicrobatchDescriptor, layer: int, ffn_in: Tensor,
                         while_waiting: Callable[[], None] | None = None) -> tuple[Tensor, float, float]:
        """Send layer `layer`'s ffn_in to the FFN worker and await its ffn_out (keyed by mb_id and layer),
        the energy of its share of the FFN forward, and that forward's compute time. `while_waiting` runs
        between the send and the wait: work that need not delay the frame."""
        seam = self.seam
        assert seam is not None
        key = (desc.mb_id, layer)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[Tensor, float, float]] = loop.create_future()
        self._replies[key] = future
        self.watch.track(key, desc.ffn_worker)
        # A timer on the future itself rather than `asyncio.wait_for`, which wakes this task through
        # an extra callback (one more turn of the event loop on every hop).
        timer = loop.call_later(self.reply_timeout_s, self._expire, future, desc, layer)
        try:
            header: dict[str, Any] = {"mb_id": desc.mb_id, "layer": layer, "direction": "to_ffn",
                                      "reply_to": self.subject, "worker_id": self.worker_id,
                                      "phase": clock_phase(desc.phase)}
            for frame in wire.encode_frames(header, ffn_in, seam.max_payload):
                seam.publish(subjects.ffn_mb(desc.ffn_worker), frame)
            if while_waiting is not None:
                while_waiting()
            out, energy_j, compute_s = await future
        finally:
            timer.cancel()
            self._replies.pop(key, None)
            self.watch.untrack(key)
        if tuple(out.shape) != tuple(ffn_in.shape):
            raise FFNReplyError(f"FFN worker {desc.ffn_worker} returned shape {list(out.shape)} for layer {layer} "
                                f"of microbatch {desc.mb_id}, expected {list(ffn_in.shape)}")
        return out.to(device=ffn_in.device, dtype=ffn_in.dtype), energy_j, compute_s

    def _silent(self, key: tuple[str, int], ffn_worker: str, silent_s: float) -> None:
        future = self._replies.get(key)
        if future is not None and not future.done():
            future.set_exception(FFNReplyError(f"FFN worker {ffn_worker} has sent no heartbeat for {silent_s:.1f} s: "
                                               f"presumed lost with layer {key[1]} of microbatch {key[0]}"))

    def seam_lost(self) -> None:
        """The seam's connection dropped: frames in flight either way may be gone, so every hop waiting
        for an answer fails now (its microbatch is reported failed and recomputed), not at its timeout."""
        for (mb_id, layer), future in list(self._replies.items()):
            if not future.done():
                future.set_exception(FFNReplyError(f"the seam's NATS connection dropped while layer {layer} of "
                                                   f"microbatch {mb_id} was at the FFN worker"))

    def _expire(self, future: asyncio.Future[Any], desc: MicrobatchDescriptor, layer: int) -> None:
        if not future.done():
            future.set_exception(FFNReplyError(f"FFN worker {desc.ffn_worker} did not answer layer {layer} of "
                                               f"microbatch {desc.mb_id} within {self.reply_timeout_s:.0f} s"))

"""The attention worker's side of the seam: each layer's ffn_in out to an FFN worker, its ffn_out back.

A hop is one seam `request`. It fails, and with it its microbatch (whose sequences the scheduler
recomputes), when the FFN worker answers with an error frame or a wrong shape, its seam breaks, it
goes silent (`FFNWatch`, from its heartbeats: the seam to it is then dropped, so nothing waits on a
hung peer), or no reply comes within `reply_timeout_s`. The FFN worker's seam address comes from
its heartbeats; the seam to it opens on the first hop, and again after it broke only once the
worker has been heard from since (a restarted worker has a new address).

A hop may wait for its reply on the event loop's own thread (`block`): one thread hand-off less
per hop, for the short waits of decode microbatches when no other microbatch could run meanwhile.
It then waits at most `silence_s` (the FFN watch cannot run while the loop waits).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from torch import Tensor

from services.attention_worker.ffn_watch import FFNWatch
from shared.error_types import FFN_UNREACHABLE, ErrorType
from shared.errors import AFlexError
from shared.kinds import clock_phase
from shared.messages import MicrobatchDescriptor
from shared.transport.header import error_text, header_for
from shared.transport.seam import Peer, Seam, SeamError

log = logging.getLogger("aflex.attention_worker")


FFN_FAILED = "microbatch_failed"  # it answered, wrongly: an error frame or a wrong shape


class FFNReplyError(AFlexError):
    """The FFN worker answered a seam frame with an error, a wrong shape, or not at all (`code` says which)."""

    error_type = ErrorType.SERVER_ERROR  # how its microbatch's `MicrobatchDone.error` is typed

    def __init__(self, message: str, code: str = FFN_UNREACHABLE) -> None:
        super().__init__(message)
        self.code = code


class FFNHops:
    def __init__(self, worker_id: str, reply_timeout_s: float, silence_s: float) -> None:
        self.worker_id, self.reply_timeout_s, self.silence_s = worker_id, reply_timeout_s, silence_s
        self.seam: Seam | None = None  # set when the worker has opened its seam
        self.watch = FFNWatch(silence_s, self._silent)
        self._address_wait_s = max(silence_s, 5.0)
        self._lost_at: dict[str, float] = {}  # FFN worker -> time.monotonic() its seam broke

    async def peer(self, ffn_worker: str) -> Peer:
        """The seam peer for `ffn_worker`, connected (opened on first use)."""
        seam = self.seam
        assert seam is not None
        lost_at = self._lost_at.get(ffn_worker)
        if lost_at is not None:
            if (self.watch.last_heard(ffn_worker) or 0.0) <= lost_at:
                raise FFNReplyError(f"the seam to FFN worker {ffn_worker} broke {time.monotonic() - lost_at:.1f} s "
                                    f"ago and it has not been heard from since")
            del self._lost_at[ffn_worker]  # alive again (restarted: a new address), so a new seam may open
        address = self.watch.addresses.get(ffn_worker) or await self.watch.address_of(ffn_worker,
                                                                                       self._address_wait_s)
        if not address:
            raise FFNReplyError(f"FFN worker {ffn_worker} has advertised no seam address "
                                f"(no heartbeat within {self._address_wait_s:.0f} s)")
        peer = Peer(ffn_worker, address)
        try:
            await seam.connect(peer)
        except SeamError as exc:
            raise FFNReplyError(str(exc)) from None
        return peer

    async def round_trip(self, desc: MicrobatchDescriptor, layer: int, ffn_in: Tensor,
                         while_waiting: Callable[[], None] | None = None, *, block: bool = False
                         ) -> tuple[Tensor, float, float]:
        """Send layer `layer`'s ffn_in to the FFN worker and return its ffn_out, the energy of its share of
        the FFN forward, and that forward's compute time. `while_waiting` runs between the send and the
        wait: work that need not delay the frame."""
        seam = self.seam
        assert seam is not None
        peer = await self.peer(desc.ffn_worker)
        key = (desc.mb_id, layer)
        header = header_for("to_ffn", desc.mb_id, layer, clock_phase(desc.phase), ffn_in)
        timeout_s = min(self.reply_timeout_s, self.silence_s) if block and self.silence_s > 0 else self.reply_timeout_s
        self.watch.track(key, desc.ffn_worker)
        try:
            reply = await seam.request(peer, header, ffn_in, timeout_s=timeout_s, block=block,
                                       after_send=while_waiting)
        except SeamError as exc:
            raise FFNReplyError(f"layer {layer} of microbatch {desc.mb_id}: {exc}") from None
        finally:
            self.watch.untrack(key)
        if reply.header.kind == "error":
            raise FFNReplyError(f"FFN worker {desc.ffn_worker} failed layer {layer} of microbatch {desc.mb_id}: "
                                f"{error_text(reply.tensor)}", FFN_FAILED)
        out = reply.tensor
        if tuple(out.shape) != tuple(ffn_in.shape) or (reply.header.mb_id, reply.header.layer) != key:
            raise FFNReplyError(f"FFN worker {desc.ffn_worker} answered layer {layer} of microbatch {desc.mb_id} "
                                f"with {list(out.shape)} for {reply.header.mb_id!r} layer {reply.header.layer}, "
                                f"expected {list(ffn_in.shape)}", FFN_FAILED)
        return out.to(device=ffn_in.device, dtype=ffn_in.dtype), reply.header.energy_j, reply.header.compute_s

    def peer_lost(self, peer: Peer, reason: str) -> None:
        """The seam to an FFN worker broke: the hops waiting on it fail in their own requests, and no new
        seam opens to it until it is heard from again (a dead worker's address would only time out)."""
        self._lost_at[peer.worker_id] = time.monotonic()
        log.info("attention worker %s: seam to %s lost (%s)", self.worker_id, peer.worker_id, reason)

    def connection_dropped(self) -> None:
        """The NATS connection dropped (the `nats` seam): frames in flight either way may be gone, so the
        seam to every FFN worker with a hop in flight is dropped (those hops fail now)."""
        if self.seam is not None:
            for ffn_worker in self.watch.ffn_workers_in_flight():
                self.seam.drop(Peer(ffn_worker, self.watch.addresses.get(ffn_worker, "")),
                               "the NATS connection dropped")

    def _silent(self, key: tuple[str, int], ffn_worker: str, silent_s: float) -> None:
        """A hop's FFN worker has sent no heartbeat for `silent_s`: presumed lost, its seam dropped."""
        if self.seam is not None:
            self.seam.drop(Peer(ffn_worker, self.watch.addresses.get(ffn_worker, "")),
                           f"no heartbeat for {silent_s:.1f} s")

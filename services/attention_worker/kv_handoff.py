"""P/D handoff, the attention worker's side: a sequence's KV moves to another attention worker over torch.distributed.

The scheduler asks the prefill worker (`attn.<wid>.kv`, a `KVHandoff`) once a sequence's prompt is in.
The prefill worker gathers every layer's K and V of the sequence's first `num_tokens` slots into one
tensor and sends it as one seam frame to the decode worker's KV seam: a `TorchSeam` of its own that
listens beside the FFN seam, so KV travels gloo (NCCL between two GPUs) and never through the
nats-server. The decode worker keeps the arrived tensor by handoff id and acknowledges on the seam;
the prefill worker then answers the scheduler, which sends the sequence's next pass to the decode
worker with `SeqWork.kv_from`: its admission writes the KV into fresh blocks (`SequenceTable.adopt`).
A tensor no pass claims within `ARRIVED_TTL_S` (the scheduler died, or moved the sequence elsewhere)
is dropped. A group's KV is split over its ranks by KV heads: the whole travels (kv_heads.py). In full:
docs/architecture.md, "P/D pools and the KV handoff".
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from services.attention_worker.sequences import SequenceRefused, SequenceTable
from shared.error_types import KV_HANDOFF_MISSING, KV_HANDOFF_UNREACHABLE, ErrorType
from shared.errors import AFlexError
from shared.messages import ErrorBody, KVHandoff, KVHandoffReply, SeqWork
from shared.model.attention import PagedKVStore
from shared.transport.header import SeamHeader
from shared.transport.seam import Frame, Peer, Seam, SeamError

log = logging.getLogger("aflex.attention_worker")

ARRIVED_TTL_S = 60.0  # an arrived KV no pass claimed for this long is dropped
EMPTY = torch.empty(0)  # the acknowledgement's payload


class KVHandoffError(AFlexError):
    """A handoff cannot be made: the sequence is unknown, busy or shorter than asked, or the peer is gone."""


def pack(kv: PagedKVStore, blocks: list[int], block_size: int, num_tokens: int) -> Tensor:
    """Every layer's K, then every layer's V, of the whole blocks that hold a sequence's first `num_tokens`
    tokens (`blocks`: its block table, in token order): -> [2 * n_layers, ceil(num_tokens / block_size) *
    block_size, Hkv, hd]; the rows past `num_tokens` are the last block's unused slots.

    Whole blocks (`block_size` consecutive slots each) are copied straight into the frame's tensor, which
    is then sent as it is (contiguous): one copy of contiguous rows per block and layer, measured 1.6-3x
    faster than gathering slot by slot on this machine's CPUs, for at most `block_size - 1` rows more."""
    caches = (*kv.k, *kv.v)
    n_blocks = -(-num_tokens // block_size)
    index = torch.tensor(blocks[:n_blocks], device=caches[0].device)
    rows = caches[0].shape[1:]
    out = torch.empty((len(caches), n_blocks * block_size, *rows), dtype=caches[0].dtype, device=caches[0].device)
    for i, cache in enumerate(caches):
        torch.index_select(cache.view(-1, block_size, *rows), 0, index, out=out[i].view(n_blocks, block_size, *rows))
    return out


def unpack(kv: PagedKVStore, slots: list[int], tensor: Tensor) -> None:
    """Write the first `len(slots)` rows of `pack`'s tensor [2 * n_layers, rows, Hkv, hd] into `slots` of every
    layer's K and V."""
    caches = (*kv.k, *kv.v)
    if tensor.shape[0] != len(caches) or tensor.shape[1] < len(slots) or tensor.shape[2:] != caches[0].shape[1:]:
        raise KVHandoffError(f"an arrived KV of shape {tuple(tensor.shape)} does not fit {len(slots)} slots of "
                             f"{len(caches)} caches of rows {tuple(caches[0].shape[1:])}")
    index = torch.tensor(slots, device=caches[0].device)
    tensor = tensor.to(device=caches[0].device, dtype=caches[0].dtype)
    for i, cache in enumerate(caches):
        cache.index_copy_(0, index, tensor[i, :len(slots)])


class HeadsKV(Protocol):
    """A group's KV, split over its ranks by heads: gathered whole, put by heads (kv_heads.GroupKV)."""

    def gather(self, kv: PagedKVStore, blocks: list[int], block_size: int, num_tokens: int) -> Tensor: ...

    def put(self, kv: PagedKVStore, slots: list[int], whole: Tensor) -> None: ...


class KVHandoffs:
    """Both ends of the handoff on one worker: `send` (the prefill side) and the arrived KV (the decode side)."""

    def __init__(self, worker_id: str, timeout_s: float) -> None:
        self.worker_id, self.timeout_s = worker_id, timeout_s
        self.seam: Seam | None = None  # set once started; None: this worker takes and sends no handoffs
        self._arrived: dict[str, tuple[Tensor, float]] = {}
        self._lock = threading.Lock()  # the seam's receiver thread adds, the event loop takes
        self.sent = self.sent_bytes = self.received = 0
        self.group_kv: HeadsKV | None = None  # rank 0 of a group: the KV is its ranks' heads (kv_heads.py)

    # -- the decode side ----------------------------------------------------------------------------

    def on_frame(self, frame: Frame) -> None:
        """A sequence's KV arrived (on the seam's receiver thread): keep it, acknowledge it."""
        now = time.monotonic()
        with self._lock:
            for key in [k for k, (_, t) in self._arrived.items() if now - t > ARRIVED_TTL_S]:
                log.info("%s: the KV of handoff %s was never claimed; dropped", self.worker_id, key)
                del self._arrived[key]
            self._arrived[frame.header.mb_id] = (frame.tensor, now)
            self.received += 1
        seam = self.seam
        if seam is not None:
            h = frame.header
            seam.reply(frame, SeamHeader(kind="to_attention", mb_id=h.mb_id, layer=0, phase=h.phase,
                                         dtype=EMPTY.dtype, shape=(0,)), EMPTY)

    def take(self, handoff_id: str) -> Tensor | None:
        with self._lock:
            arrived = self._arrived.pop(handoff_id, None)
        return None if arrived is None else arrived[0]

    def peer_lost(self, peer: Peer, reason: str) -> None:
        log.info("%s: KV seam to %s lost: %s", self.worker_id, peer.worker_id, reason)

    # -- the prefill side ---------------------------------------------------------------------------

    async def send(self, req: KVHandoff, sequences: SequenceTable, kv: PagedKVStore,
                   busy: Callable[[str], bool]) -> KVHandoffReply:
        """Move the KV of `req.seq_id`'s first `req.num_tokens` tokens to `req.to_worker`; the reply says how."""
        started = time.perf_counter()
        try:
            if self.seam is None:
                raise KVHandoffError(f"attention worker {self.worker_id} has no KV seam (seam_transport nats)")
            if req.seq_id not in sequences or busy(req.seq_id):
                raise KVHandoffError(f"sequence {req.seq_id} is {'busy' if busy(req.seq_id) else 'unknown'} on "
                                     f"{self.worker_id}")
            held = sequences.num_computed(req.seq_id)
            if not 0 < req.num_tokens <= held:
                raise KVHandoffError(f"sequence {req.seq_id}: {req.num_tokens} tokens asked, {held} in the cache")
            tables = sequences.block_tables
            blocks = tables.block_table(req.seq_id)
            if self.group_kv is not None:  # the group's heads gathered whole: a command and its collective
                tensor = await asyncio.to_thread(self.group_kv.gather, kv, blocks, tables.block_size, req.num_tokens)
            else:
                with torch.inference_mode():
                    tensor = pack(kv, blocks, tables.block_size, req.num_tokens)  # [2L, n, Hkv, hd]
            peer = Peer(req.to_worker, req.to_address)
            await self.seam.connect(peer)
            header = SeamHeader(kind="to_attention", mb_id=req.handoff_id, layer=0, phase="prefill",
                                dtype=tensor.dtype, shape=tuple(tensor.shape))
            reply = await self.seam.request(peer, header, tensor, timeout_s=self.timeout_s)
            if reply.header.kind == "error":
                raise KVHandoffError(f"{req.to_worker} refused the KV: {bytes(reply.tensor.numpy()).decode()}")
        except Exception as exc:  # a seam error, a refusal, a sequence not there: the scheduler keeps it here
            log.warning("%s: KV handoff %s of %s to %s failed: %s", self.worker_id, req.handoff_id, req.seq_id,
                        req.to_worker, exc)
            code = KV_HANDOFF_UNREACHABLE if isinstance(exc, SeamError) else "kv_handoff_failed"
            return KVHandoffReply(handoff_id=req.handoff_id, ok=False, seconds=time.perf_counter() - started,
                                  error=ErrorBody(type=ErrorType.SERVER_ERROR, message=str(exc), code=code))
        nbytes = tensor.numel() * tensor.element_size()
        self.sent += 1
        self.sent_bytes += nbytes
        return KVHandoffReply(handoff_id=req.handoff_id, ok=True, nbytes=nbytes, seconds=time.perf_counter() - started)


def adopt(sequences: SequenceTable, kv: PagedKVStore, handoffs: KVHandoffs, work: SeqWork) -> None:
    """A handed-off sequence's first pass here: its KV, arrived on the KV seam, into fresh blocks."""
    assert work.kv_from is not None
    arrived = handoffs.take(work.kv_from)
    if arrived is None:
        raise SequenceRefused(KV_HANDOFF_MISSING, f"sequence {work.seq_id}: the KV of handoff {work.kv_from} is "
                              f"not on {handoffs.worker_id} (resend it from start_pos 0)", ErrorType.SERVER_ERROR)
    slots = sequences.adopt(work)
    try:
        if handoffs.group_kv is not None:  # each rank of the group its own heads
            handoffs.group_kv.put(kv, slots, arrived)
        else:
            with torch.inference_mode():
                unpack(kv, slots, arrived)
    except KVHandoffError as exc:
        sequences.free(work.seq_id)
        raise SequenceRefused(KV_HANDOFF_MISSING, f"sequence {work.seq_id}: {exc}", ErrorType.SERVER_ERROR) from None

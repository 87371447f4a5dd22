"""The seam frame's header: a frozen dataclass with one fixed binary layout, read and written only here.

Every seam frame is one `SeamHeader` plus one tensor's bytes. The header is a fixed `HEADER_BYTES`
long, so a receiver can post a buffer before it knows anything about the frame, and it is the same
on every seam transport (torch.distributed or NATS). Layout (network byte order, `struct` format
`_LAYOUT`): magic `AFS1` | kind u8 | phase u8 | dtype u8 | ndim u8 | on_device u8 | 3 pad | layer
i32 | reply_tag u32 | device_seq u32 | shape 4 x u64 | nbytes u64 | energy_j f64 | compute_s f64 | mb_id length u16 |
mb_id `MB_ID_MAX_BYTES` (utf-8, zero padded) | zero padding to a multiple of 16 bytes, so that a
payload right after the header can be viewed as any dtype in place.

An error frame (`kind` "error") carries the error's text as its payload (dtype uint8), so the
attention side hears why its layer failed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal

import torch

from shared.errors import AFlexError
from shared.kinds import ClockPhase

FrameKind = Literal["to_ffn", "to_attention", "error"]

MAGIC = b"AFS1"
MB_ID_MAX_BYTES = 192
ERROR_TEXT_MAX_BYTES = 4096  # an error frame's reason is cut to this (a requester's reply buffer holds it)
MAX_DIMS = 4
_FIELDS = f"!4sBBBBB3xiII{MAX_DIMS}QQddH{MB_ID_MAX_BYTES}s"
END_PAD_BYTES = -struct.calcsize(_FIELDS) % 16  # the payload after the header stays aligned
_LAYOUT = struct.Struct(_FIELDS + f"{END_PAD_BYTES}x")
HEADER_BYTES = _LAYOUT.size

_KINDS: tuple[FrameKind, ...] = ("to_ffn", "to_attention", "error")
_PHASES: tuple[ClockPhase, ...] = ("decode", "prefill")  # wire codes: this order is the protocol
_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8)


class SeamFrameError(AFlexError):
    """A seam frame is malformed: bad magic, an unknown code, a field out of range, or a byte count
    that does not match its shape."""


@dataclass(frozen=True)
class SeamHeader:
    """Which microbatch and layer a seam tensor belongs to, what it is, and (on replies) what it cost."""

    kind: FrameKind
    mb_id: str
    layer: int
    phase: ClockPhase
    dtype: torch.dtype
    shape: tuple[int, ...]
    energy_j: float = 0.0  # FFN -> attention: this frame's share of the FFN forward's GPU energy
    compute_s: float = 0.0  # FFN -> attention: that forward's compute time
    on_device: bool = False  # the payload travels GPU to GPU (NCCL), not inline with the header
    reply_tag: int = 0  # a request: where its reply goes (the sender's receive); a reply: the request's
    device_seq: int = 0  # on_device: the payload's place in the pair's NCCL order (NCCL matches by order)

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 0

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * self.dtype.itemsize

    def pack(self) -> bytes:
        buffer = bytearray(HEADER_BYTES)
        self.pack_into(buffer)
        return bytes(buffer)

    def pack_into(self, buffer: bytearray | memoryview, *, reply_tag: int | None = None,
                  device_seq: int | None = None, on_device: bool | None = None) -> None:
        """Write the header at the start of `buffer` (a frame's own message buffer: no copy), with the
        fields the transport decides given here."""
        reply_tag = self.reply_tag if reply_tag is None else reply_tag
        device_seq = self.device_seq if device_seq is None else device_seq
        on_device = self.on_device if on_device is None else on_device
        mb_id = self.mb_id.encode()
        if len(mb_id) > MB_ID_MAX_BYTES:
            raise SeamFrameError(f"microbatch id {self.mb_id[:40]!r}... is over {MB_ID_MAX_BYTES} bytes")
        if not (0 <= reply_tag < 1 << 32 and 0 <= device_seq < 1 << 32):
            raise SeamFrameError(f"reply tag {reply_tag} or device seq {device_seq} is not a u32")
        if len(self.shape) > MAX_DIMS or any(d < 0 for d in self.shape):
            raise SeamFrameError(f"a seam tensor has at most {MAX_DIMS} non-negative dims, got {list(self.shape)}")
        if self.dtype not in _DTYPES:
            raise SeamFrameError(f"unsupported seam dtype {self.dtype} (supported: {_names()})")
        dims = (*self.shape, *(0,) * (MAX_DIMS - len(self.shape)))
        _LAYOUT.pack_into(buffer, 0, MAGIC, _KINDS.index(self.kind), _PHASES.index(self.phase),
                          _DTYPES.index(self.dtype), len(self.shape), int(on_device), self.layer, reply_tag, device_seq,
                          *dims, self.nbytes, self.energy_j, self.compute_s, len(mb_id), mb_id)

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> SeamHeader:
        if len(data) < HEADER_BYTES:
            raise SeamFrameError(f"a seam header is {HEADER_BYTES} bytes, got {len(data)}")
        magic, kind, phase, dtype, ndim, on_device, layer, reply_tag, device_seq, *rest = _LAYOUT.unpack_from(data)
        dims, (nbytes, energy_j, compute_s, id_len, mb_id) = rest[:MAX_DIMS], rest[MAX_DIMS:]
        if magic != MAGIC:
            raise SeamFrameError("not an AFlex seam frame (bad magic)")
        if kind >= len(_KINDS) or phase >= len(_PHASES) or dtype >= len(_DTYPES) or ndim > MAX_DIMS \
                or id_len > MB_ID_MAX_BYTES:
            raise SeamFrameError(f"bad seam header codes: kind {kind}, phase {phase}, dtype {dtype}, ndim {ndim}")
        header = cls(kind=_KINDS[kind], mb_id=mb_id[:id_len].decode(errors="replace"), layer=layer,
                     phase=_PHASES[phase], dtype=_DTYPES[dtype], shape=tuple(dims[:ndim]), energy_j=energy_j,
                     compute_s=compute_s, on_device=bool(on_device), reply_tag=reply_tag, device_seq=device_seq)
        if header.nbytes != nbytes:
            raise SeamFrameError(f"seam header says {nbytes} bytes but shape {list(header.shape)} of "
                                 f"{header.dtype} holds {header.nbytes}")
        return header


def header_for(kind: FrameKind, mb_id: str, layer: int, phase: ClockPhase, tensor: torch.Tensor, *,
               energy_j: float = 0.0, compute_s: float = 0.0) -> SeamHeader:
    """The header that describes `tensor` (its dtype and shape)."""
    return SeamHeader(kind=kind, mb_id=mb_id, layer=layer, phase=phase, dtype=tensor.dtype,
                      shape=tuple(tensor.shape), energy_j=energy_j, compute_s=compute_s)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A payload's bytes: the tensor's storage as flat uint8 (a view when it is contiguous)."""
    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return tensor.contiguous().view(-1).view(torch.uint8)


def error_payload(message: str) -> torch.Tensor:
    """An error frame's payload: the message as utf-8 bytes ([n] uint8), at most ERROR_TEXT_MAX_BYTES."""
    data = message.encode()[:ERROR_TEXT_MAX_BYTES]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def error_text(payload: torch.Tensor) -> str:
    return bytes(payload.numpy().tobytes()).decode(errors="replace")


def _names() -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in _DTYPES)

"""Tensor frames: a small descriptor plus the tensor's raw bytes, chunked above max_payload.

A frame is `MAGIC | u32 header length | orjson header | raw bytes`. The header says which
microbatch, layer and direction the tensor belongs to, its dtype and shape, and which chunk of
how many this is; the receiver's `FrameAssembler` puts chunks back together. No pickle; the
sender copies the tensor's storage once, into the payload; the receiver makes the tensor on the
payload itself when it is a writable `bytearray` (what the seam link delivers), and copies it once
when it is immutable `bytes` (`torch.frombuffer` needs a writable buffer).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import orjson

from shared.errors import AFlexError

MAGIC = b"AFX1"
_LEN = struct.Struct("!I")
_DTYPES = ("float32", "bfloat16", "float16")


class FrameError(AFlexError):
    """A tensor frame is malformed: wrong magic, header or byte count."""


def _torch_dtype(name: str) -> Any:
    import torch

    if name not in _DTYPES:
        raise FrameError(f"unsupported tensor dtype {name!r} in frame (supported: {', '.join(_DTYPES)})")
    return getattr(torch, name)


def _raw_view(tensor: Any) -> memoryview:
    """The tensor's bytes as a flat view of its own storage: a copy only for a non-contiguous or
    non-CPU tensor (bf16/f16 go through an int16 view, which numpy can hold)."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def encode_frames(header: dict[str, Any], tensor: Any, max_payload: int) -> list[bytes]:
    """Frames for `tensor` with `header` (which must not use the keys dtype/shape/chunk/chunks/nbytes).

    The tensor's bytes are copied once, straight from its storage into each frame (this sits on
    every seam hop, twice per layer).
    """
    raw = _raw_view(tensor)
    dtype = str(tensor.dtype).removeprefix("torch.")
    base = {**header, "dtype": dtype, "shape": list(tensor.shape), "nbytes": len(raw)}
    head = orjson.dumps({**base, "chunk": 0, "chunks": 1})
    room = max_payload - 1024 - len(head)  # leave space for the header itself
    if room <= 0:
        raise FrameError(f"max_payload {max_payload} is too small for a frame header")
    if len(raw) <= room:  # the common case: one frame, one header
        return [b"".join((MAGIC, _LEN.pack(len(head)), head, raw))]
    chunks = -(-len(raw) // room)
    frames = []
    for index in range(chunks):
        head = orjson.dumps({**base, "chunk": index, "chunks": chunks})
        frames.append(b"".join((MAGIC, _LEN.pack(len(head)), head, raw[index * room:(index + 1) * room])))
    return frames


def decode_frame(payload: bytes | bytearray) -> tuple[dict[str, Any], memoryview]:
    if payload[:4] != MAGIC or len(payload) < 8:
        raise FrameError("not an AFlex tensor frame (bad magic)")
    (head_len,) = _LEN.unpack_from(payload, 4)
    try:
        header = orjson.loads(payload[8:8 + head_len])
    except orjson.JSONDecodeError as exc:
        raise FrameError(f"bad frame header: {exc}") from None
    return header, memoryview(payload)[8 + head_len:]


def frame_tensor(header: dict[str, Any], raw: bytes | bytearray | memoryview) -> Any:
    import torch

    dtype = _torch_dtype(header["dtype"])
    if len(raw) != header["nbytes"]:
        raise FrameError(f"frame carries {len(raw)} bytes, header says {header['nbytes']}")
    if header["nbytes"] == 0:
        return torch.empty(header["shape"], dtype=dtype)
    # a writable buffer (a bytearray payload from the seam link) becomes the tensor's storage as it
    # is; read-only bytes are copied once, since torch.frombuffer needs to be able to write
    buffer = raw if isinstance(raw, memoryview) and not raw.readonly else bytearray(raw)
    if dtype == torch.float32:  # the seam's usual case: one tensor op, not three (this runs twice per hop)
        return torch.frombuffer(buffer, dtype=dtype).view(header["shape"])
    return torch.frombuffer(buffer, dtype=torch.int16).view(dtype).view(header["shape"])


@dataclass
class _Partial:
    header: dict[str, Any]
    parts: dict[int, bytes] = field(default_factory=dict)


class FrameAssembler:
    """Collects chunks; returns (header, tensor) once a tensor's last chunk has arrived."""

    def __init__(self) -> None:
        self._partials: dict[tuple[Any, ...], _Partial] = {}

    def add(self, payload: bytes | bytearray, key_fields: tuple[str, ...] = ("mb_id", "layer", "direction")
            ) -> tuple[dict[str, Any], Any] | None:
        header, raw = decode_frame(payload)
        if header.get("chunks", 1) == 1:
            return header, frame_tensor(header, raw)
        key = tuple(header.get(k) for k in key_fields)
        partial = self._partials.setdefault(key, _Partial(header))
        partial.parts[header["chunk"]] = bytes(raw)
        if len(partial.parts) < header["chunks"]:
            return None
        del self._partials[key]
        joined = b"".join(partial.parts[i] for i in range(header["chunks"]))
        return header, frame_tensor(header, joined)

    def pending(self) -> int:
        return len(self._partials)

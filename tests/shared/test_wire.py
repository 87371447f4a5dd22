"""Tensor frames (shared/wire.py): exact round trips in every seam dtype, chunking, and clear errors."""

from __future__ import annotations

import orjson
import pytest
import torch

from shared import wire

HEADER = {"mb_id": "run-attn-0-3-1", "layer": 7, "direction": "to_ffn", "reply_to": "aflex.v1.attn.attn-0.mb"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("as_bytearray", [False, True], ids=["bytes", "bytearray"])
def test_one_frame_round_trips_bit_for_bit(dtype: torch.dtype, as_bytearray: bool) -> None:
    tensor = torch.randn(16, 576).to(dtype)  # [T, D]: a decode microbatch's ffn_in
    (frame,) = wire.encode_frames(HEADER, tensor, 8 * 1024 * 1024)
    payload = bytearray(frame) if as_bytearray else frame
    header, tensor_out = wire.FrameAssembler().add(payload)  # type: ignore[misc]
    assert {k: header[k] for k in HEADER} == HEADER
    assert header["shape"] == [16, 576] and header["chunks"] == 1
    assert tensor_out.dtype == dtype and torch.equal(tensor_out, tensor)


def test_a_bytearray_payload_becomes_the_tensor_storage_and_bytes_are_copied() -> None:
    """The seam link hands over a bytearray of its own: the tensor is made on it with no copy."""
    tensor = torch.arange(12, dtype=torch.float32).view(3, 4)
    (frame,) = wire.encode_frames(HEADER, tensor, 1 << 20)
    owned = bytearray(frame)
    header, raw = wire.decode_frame(owned)
    shared = wire.frame_tensor(header, raw)
    owned[-4:] = torch.tensor([99.0]).numpy().tobytes()  # the last element, in place
    assert shared[2, 3].item() == 99.0
    header, raw = wire.decode_frame(frame)
    copied = wire.frame_tensor(header, raw)
    assert copied[2, 3].item() == 11.0 and copied.flatten().tolist() == list(range(12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frames_over_max_payload_are_chunked_and_reassembled(dtype: torch.dtype) -> None:
    tensor = torch.randn(300, 64).to(dtype)
    frames = wire.encode_frames(HEADER, tensor, 4096)
    assert len(frames) > 1 and all(len(f) <= 4096 for f in frames)
    assembler = wire.FrameAssembler()
    results = [assembler.add(f) for f in reversed(frames)]  # any arrival order
    assert results[:-1] == [None] * (len(frames) - 1) and assembler.pending() == 0
    last = results[-1]
    assert last is not None and torch.equal(last[1], tensor)


def test_empty_tensor_round_trips() -> None:
    (frame,) = wire.encode_frames({**HEADER, "error": "bad layer"}, torch.empty(0), 1 << 20)
    header, tensor = wire.FrameAssembler().add(frame)  # type: ignore[misc]
    assert header["error"] == "bad layer" and tensor.numel() == 0


def test_malformed_frames_raise_frame_errors() -> None:
    (frame,) = wire.encode_frames(HEADER, torch.ones(2, 2), 1 << 20)
    with pytest.raises(wire.FrameError, match="bad magic"):
        wire.decode_frame(b"JSON" + frame[4:])
    head_len = int.from_bytes(frame[4:8], "big")
    head = orjson.loads(frame[8:8 + head_len])
    with pytest.raises(wire.FrameError, match="header says"):
        wire.frame_tensor(head, memoryview(frame)[8 + head_len:-4])
    with pytest.raises(wire.FrameError, match="unsupported tensor dtype 'int64'"):
        wire.frame_tensor({**head, "dtype": "int64"}, memoryview(frame)[8 + head_len:])
    with pytest.raises(wire.FrameError, match="too small"):
        wire.encode_frames(HEADER, torch.ones(2, 2), 100)

"""`SeamHeader`: one fixed binary layout, every field back as it went in, and clear errors for bad bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.transport.header import (
    HEADER_BYTES,
    MB_ID_MAX_BYTES,
    SeamFrameError,
    SeamHeader,
    error_payload,
    error_text,
    header_for,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8])
@pytest.mark.parametrize("kind", ["to_ffn", "to_attention", "error"])
def test_every_field_round_trips(dtype: torch.dtype, kind: str) -> None:
    header = SeamHeader(kind=kind, mb_id="run7-attn-0-1234-r", layer=63, phase="prefill", dtype=dtype,  # type: ignore[arg-type]
                        shape=(17, 5120), energy_j=0.125, compute_s=3.5e-4, on_device=kind == "to_ffn",
                        reply_tag=(1 << 30) - 1, device_seq=(1 << 32) - 1)
    packed = header.pack()
    assert len(packed) == HEADER_BYTES
    assert SeamHeader.unpack(packed) == header
    assert SeamHeader.unpack(packed + b"payload follows") == header  # the header reads only its own bytes


def test_header_for_describes_the_tensor() -> None:
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    header = header_for("to_ffn", "m", 2, "decode", x)
    assert header.shape == (3, 64) and header.dtype == torch.bfloat16 and header.rows == 3
    assert header.nbytes == x.numel() * x.element_size()
    empty = header_for("to_attention", "m", 0, "decode", torch.empty(0, 64))
    assert SeamHeader.unpack(empty.pack()).nbytes == 0


def test_error_frames_carry_their_text() -> None:
    payload = error_payload("layer 99 is not in [0, 4) — ünïcode")
    assert payload.dtype == torch.uint8 and error_text(payload) == "layer 99 is not in [0, 4) — ünïcode"
    assert error_text(error_payload("")) == ""


def test_bad_bytes_are_typed_errors_that_say_what_is_wrong() -> None:
    good = header_for("to_ffn", "m", 1, "decode", torch.zeros(2, 8)).pack()
    with pytest.raises(SeamFrameError, match="bad magic"):
        SeamHeader.unpack(b"XXXX" + good[4:])
    with pytest.raises(SeamFrameError, match=f"{HEADER_BYTES} bytes"):
        SeamHeader.unpack(good[:10])
    with pytest.raises(SeamFrameError, match="codes"):
        SeamHeader.unpack(good[:4] + b"\x09" + good[5:])  # no such kind
    nbytes_at = 4 + 5 + 3 + 4 + 4 + 4 + 8 * 4  # magic, five u8, pad, layer, reply_tag, device_seq, shape
    wrong = good[:nbytes_at] + (1).to_bytes(8, "big") + good[nbytes_at + 8:]
    with pytest.raises(SeamFrameError, match="says 1 bytes"):
        SeamHeader.unpack(wrong)


def test_headers_that_cannot_be_written_are_refused() -> None:
    base = header_for("to_ffn", "m", 1, "decode", torch.zeros(2, 8))
    with pytest.raises(SeamFrameError, match="over 192 bytes"):
        dataclasses.replace(base, mb_id="x" * (MB_ID_MAX_BYTES + 1)).pack()
    with pytest.raises(SeamFrameError, match="at most 4"):
        dataclasses.replace(base, shape=(1, 2, 3, 4, 5)).pack()
    with pytest.raises(SeamFrameError, match="unsupported seam dtype"):
        dataclasses.replace(base, dtype=torch.float64).pack()

"""One attention/FFN pair on torch.distributed: how a seam frame becomes gloo (and NCCL) messages.

A frame whose header and payload fit in `INLINE_BYTES` is one gloo message, received into a buffer
posted before anything is known about it (gloo accepts a message shorter than the posted buffer,
and the header says how much of it is the tensor). A larger frame is the header alone, then the
payload, received straight into a tensor of its size. With `on_device` set the payload goes GPU to
GPU on the pair's NCCL group instead, the header still on gloo; NCCL pairs sends and receives by
order alone, so each such header carries the payload's place in that order (`device_seq`) and the
receiver posts its NCCL receives in it.

Requests travel on `REQUEST_TAG`; each reply on the tag its request named (`reply_tag`), where the
requester posted a receive for it before sending, so replies may come back in any order.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
from datetime import timedelta
from typing import Any

import numpy as np
import torch
from torch import Tensor

from shared.transport.header import ERROR_TEXT_MAX_BYTES, HEADER_BYTES, SeamFrameError, SeamHeader, as_bytes

INLINE_BYTES = 1 << 20  # header + payload up to this go as one message (a decode hop always does)
ERROR_ROOM_BYTES = ERROR_TEXT_MAX_BYTES  # a reply buffer is at least this big, so an error frame fits
REQUEST_TAG = 1
FIRST_REPLY_TAG = 2
LAST_REPLY_TAG = (1 << 30) - 1
ABORT_TAG = 1 << 30  # never sent: a receive on it that times out is how a pair is aborted
SENDS_KEPT = 64  # posted sends (and the tensors they read) kept before the oldest, long done, is reaped


class Pair:
    """The groups to one peer: gloo always, NCCL too between two GPUs. `other` is the peer's rank."""

    def __init__(self, peer: Any, gloo: Any, nccl: Any, other_rank: int, device: torch.device) -> None:
        self.peer, self.gloo, self.nccl, self.other, self.device = peer, gloo, nccl, other_rank, device
        self.lost = False
        self._tags = itertools.cycle(range(FIRST_REPLY_TAG, LAST_REPLY_TAG))
        # NCCL matches sends and receives by order, not tag: payloads carry their place in it
        self._device_sent = itertools.count()
        self._device_next = 0  # the next payload place to receive
        self._device_turn = threading.Condition()
        self._sent: collections.deque[tuple[list[Any], tuple[Tensor, ...]]] = collections.deque()

    def next_reply_tag(self) -> int:
        return next(self._tags)

    # -- sending --------------------------------------------------------------------------------

    def send(self, header: SeamHeader, tensor: Tensor, tag: int, *, reply_tag: int | None = None,
             on_device: bool = False) -> None:
        """Post the frame's messages; gloo completes them on its own thread (raises RuntimeError when
        the pair is broken). `reply_tag` and `on_device` override the header's."""
        if on_device:
            head = np.empty(HEADER_BYTES, dtype=np.uint8)
            header.pack_into(head.data, reply_tag=reply_tag, on_device=True,
                             device_seq=next(self._device_sent) % (1 << 32))
            msg = torch.from_numpy(head)
            works = [self.gloo.send([msg], self.other, tag), self.nccl.send([tensor], self.other, tag)]
            keep: tuple[Tensor, ...] = (msg, tensor)
        else:
            payload = as_bytes(tensor)
            inline = HEADER_BYTES + payload.numel() <= INLINE_BYTES
            # numpy copies, not torch's: a torch copy this size runs on the intra-op thread pool, whose
            # spinning threads then hold a core the peer's gloo thread needs (measured: a 4-8 ms tail on
            # one hop in ten on 2 cores)
            raw = np.empty(HEADER_BYTES + payload.numel() if inline else HEADER_BYTES, dtype=np.uint8)
            header.pack_into(raw.data, reply_tag=reply_tag, on_device=False)
            if inline:
                raw[HEADER_BYTES:] = payload.numpy()
            msg = torch.from_numpy(raw)
            if inline:
                works, keep = [self.gloo.send([msg], self.other, tag)], (msg,)
            else:
                works = [self.gloo.send([msg], self.other, tag), self.gloo.send([payload], self.other, tag)]
                keep = (msg, payload)
        self._sent.append((works, keep))
        if len(self._sent) > SENDS_KEPT:
            for work in self._sent.popleft()[0]:
                work.wait()  # long done: the peer has answered many frames since

    # -- receiving ------------------------------------------------------------------------------

    def post_receive(self, buffer: np.ndarray, tag: int) -> Any:
        """Post a receive into `buffer` (uint8, numpy: its bytes are read and viewed without torch ops)."""
        return self.gloo.recv([torch.from_numpy(buffer)], self.other, tag)

    def finish_receive(self, buffer: np.ndarray, work: Any, tag: int, timeout: timedelta, *, copy: bool
                       ) -> tuple[SeamHeader, Tensor]:
        """Wait for the frame whose first message lands in `buffer`, then its payload if that follows
        separately. `copy`: the buffer is reused, so an inline payload is copied out of it."""
        work.wait(timeout)
        header = SeamHeader.unpack(buffer.data)
        nbytes = header.nbytes
        if header.on_device:
            if self.nccl is None:
                raise SeamFrameError("a GPU-to-GPU frame on a pair without NCCL")
            tensor = torch.empty(header.shape, dtype=header.dtype, device=self.device)
            with self._device_turn:  # receive the payloads in the order they were sent
                if not self._device_turn.wait_for(lambda: self._device_next == header.device_seq % (1 << 32),
                                                  timeout.total_seconds()):
                    raise SeamFrameError(f"GPU payload {header.device_seq} never came up in order")
                self.nccl.recv([tensor], self.other, tag).wait()
                torch.cuda.current_stream(self.device).synchronize()
                self._device_next = (self._device_next + 1) % (1 << 32)
                self._device_turn.notify_all()
            return header, tensor
        if HEADER_BYTES + nbytes <= INLINE_BYTES:
            if HEADER_BYTES + nbytes > buffer.size:
                raise SeamFrameError(f"a {nbytes}-byte frame does not fit the {buffer.size}-byte buffer posted")
            raw = buffer[HEADER_BYTES:HEADER_BYTES + nbytes]
            if copy:  # out of the reused buffer (with numpy: see `send`)
                raw = raw.copy()
            if header.dtype == torch.float32:  # the usual case: one torch call
                return header, torch.from_numpy(raw.view(np.float32).reshape(header.shape))
            return header, torch.from_numpy(raw).view(header.dtype).view(header.shape)
        tensor = torch.empty(header.shape, dtype=header.dtype)
        self.gloo.recv([as_bytes(tensor)], self.other, tag).wait(timeout)
        return header, tensor

    def abort(self) -> None:
        """gloo has no working abort: a receive that times out after 1 ms makes it close the pair, and
        every operation waiting on the pair then fails."""
        self.lost = True
        with contextlib.suppress(Exception):
            self.gloo.recv([torch.empty(1)], self.other, ABORT_TAG).wait(timedelta(milliseconds=1))

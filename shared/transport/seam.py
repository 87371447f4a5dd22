"""The seam interface: send a frame to a peer and take its reply; receive frames from any peer.

Both workers move their per-layer tensors through one `Seam`, whatever carries them, so the
transport is a setting (`seam_transport`) and not a code path in each worker:

- `torch` (default, `torch_seam.TorchSeam`): torch.distributed point-to-point on a 2-rank process
  group per attention/FFN pair, gloo for CPU tensors and NCCL for CUDA tensors;
- `nats` (`nats_seam.NatsSeam`): the frames as NATS messages on the worker's nats-py connection,
  for meshes whose workers reach each other only through NATS.

The attention worker `request`s: one frame out, its reply back (matched by the header's
`reply_tag`). The FFN worker listens: its seam has an `address`, advertised in its registration and
heartbeats, hands every frame from any peer to `on_frame`, and answers with `reply`. On the torch
seam `on_frame` runs on the receiving thread (so the FFN serves without a trip through the event
loop; it must be thread-safe); on the nats seam, on the event loop. `on_peer_lost` always runs on
the event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from torch import Tensor

from shared.errors import AFlexError
from shared.transport.header import SeamHeader

SeamTransport = Literal["torch", "nats"]


class SeamError(AFlexError):
    """A seam frame could not be sent or received: the peer is unreachable, gone, or timed out."""


@dataclass(frozen=True)
class Peer:
    """The other end of a seam: its worker id, and the address frames to it go to."""

    worker_id: str
    address: str


@dataclass(frozen=True)
class Frame:
    """One frame off the seam, with the peer to answer (`seam.send(frame.peer, ...)`)."""

    peer: Peer
    header: SeamHeader
    tensor: Tensor  # as the header describes it; on CPU unless it came GPU to GPU


OnFrame = Callable[[Frame], None]
OnPeerLost = Callable[[Peer, str], None]  # (the peer, why)


class Seam(Protocol):
    @property
    def address(self) -> str:
        """Where peers reach this end ("" when it only sends requests)."""
        ...

    async def start(self) -> None: ...

    async def connect(self, peer: Peer) -> None:
        """Be ready to send to `peer` (at once when already connected); raises `SeamError`."""
        ...

    async def request(self, peer: Peer, header: SeamHeader, tensor: Tensor, *, timeout_s: float,
                      block: bool = False, after_send: Callable[[], None] | None = None) -> Frame:
        """Send a frame to a connected `peer` and return its reply (a frame of the request's shape, or an
        error frame); raises `SeamError` when the peer is lost or silent for `timeout_s`. `block`: wait on
        this thread, not through the event loop (for short waits when nothing else would run meanwhile).
        `after_send` runs once the frame is on its way."""
        ...

    def reply(self, request: Frame, header: SeamHeader, tensor: Tensor) -> None:
        """Answer `request` (from any thread that serves it); a lost peer's reply is dropped."""
        ...

    def drop(self, peer: Peer, reason: str) -> None:
        """Tear down what connects to `peer` (it is gone or hung): anything waiting on it fails now."""
        ...

    async def close(self) -> None: ...

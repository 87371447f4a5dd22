"""The `torch` seam: frames on torch.distributed point-to-point, one 2-rank process group per pair.

No world: a pair's group is made through a `TCPStore` the FFN worker hosts and advertises (its
`seam_address`) when the attention worker first sends to it, on a store prefix never reused, so
workers join and leave at any time; NCCL joins gloo when the two sit on different GPUs. Few threads,
because each hand-off costs tens of microseconds a hop: the FFN side's receiver thread per pair serves
frames itself, and the attention side waits for decode replies on the event loop's own thread
(`_drive`). Rendezvous, frames and threads in full: docs/architecture.md, "The torch seam".
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import socket
import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import numpy as np
import orjson
import torch
from torch import Tensor
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.distributed_c10d import ProcessGroupGloo

from shared.torch_threads import with_torch_threads
from shared.transport.header import SeamHeader
from shared.transport.seam import Frame, OnFrame, OnPeerLost, Peer, SeamError
from shared.transport.torch_pair import (
    ERROR_ROOM_BYTES,
    HEADER_BYTES,
    INLINE_BYTES,
    REQUEST_TAG,
    Pair,
)

log = logging.getLogger("aflex.seam")

STORE_CONNECT_TIMEOUT = timedelta(seconds=3)  # how long an attention worker tries to reach a peer's store
IDLE_WAIT = timedelta(days=1)  # an FFN receiver's wait for the next frame (a timeout closes the pair)
JOIN_IDLE_WAIT = timedelta(hours=1)  # the acceptor's wait for the next join (a timeout: wait again)


def local_host_towards(url: str) -> str:
    """This machine's address on the route to `url`'s (first) host (what peers there can reach)."""
    host = urlsplit(url.split(",")[0].strip()).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))  # UDP: nothing is sent, the kernel only picks the route
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


@dataclass
class _Pending:
    """A request waiting for its reply on the event loop's thread."""

    pair: Pair
    buffer: np.ndarray
    work: Any
    tag: int
    timeout: timedelta
    future: asyncio.Future[Frame]
    counted: int = 0  # 1 while settled and its request has not run yet


class TorchSeam:
    """The seam on torch.distributed. `listen=True` (the FFN worker) hosts a store and accepts pairs."""

    def __init__(self, worker_id: str, on_frame: OnFrame, on_peer_lost: OnPeerLost, *, host: str,
                 listen: bool, device: str = "cpu", connect_timeout_s: float = 10.0) -> None:
        self.worker_id, self.host, self.listen = worker_id, host, listen
        self.on_frame, self.on_peer_lost = on_frame, on_peer_lost
        self.device = torch.device(device)
        self.gpu_uuid = str(torch.cuda.get_device_properties(self.device).uuid) if self.device.type == "cuda" else ""
        self.timeout = timedelta(seconds=connect_timeout_s)
        self._pairs: dict[str, Pair] = {}  # by peer address (an accepted pair: "accepted/<n>")
        self._connecting: dict[str, asyncio.Future[None]] = {}  # rendezvous under way, by peer address
        self._store: TCPStore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        self._waiters = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="seam-wait")
        self._in_order: collections.deque[_Pending] = collections.deque()  # `block` requests, oldest first
        self._settled = 0  # replies handed to their requests that have not run yet
        self._drive_scheduled = False
        self._warned_host_copy = False
        self._next_join = 1  # the join number the acceptor waits for

    @property
    def address(self) -> str:
        if self._store is None:
            return ""
        return f"gloo://{self.host}:{self._store.port}" + (f"?gpu={self.gpu_uuid}" if self.gpu_uuid else "")

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.listen:
            self._store = await asyncio.to_thread(lambda: TCPStore(
                "0.0.0.0", 0, world_size=None, is_master=True, timeout=self.timeout, wait_for_workers=False))
            self._thread(self._accept, "seam-acceptor")

    # -- the attention side: connect, request ---------------------------------------------------

    async def connect(self, peer: Peer) -> None:
        if peer.address in self._pairs:
            return
        opening = self._connecting.get(peer.address)
        if opening is None:  # one rendezvous per peer, however many microbatches wait for it
            opening = self._connecting[peer.address] = asyncio.ensure_future(self._open(peer))
            opening.add_done_callback(lambda done: done.cancelled() or done.exception())  # always retrieved
        try:
            await asyncio.shield(opening)  # a cancelled caller does not cancel the others' rendezvous
        except Exception as exc:  # refused, timed out, a half that went away mid-rendezvous
            raise SeamError(f"cannot open the seam to {peer.worker_id} at {peer.address}: {exc}") from None

    async def _open(self, peer: Peer) -> None:
        try:
            pair = await asyncio.to_thread(self._join, peer)
        finally:
            del self._connecting[peer.address]
        self._pairs[peer.address] = pair
        log.info("seam to %s open at %s (%s)", peer.worker_id, peer.address,
                 "gloo + nccl" if pair.nccl is not None else "gloo")

    async def request(self, peer: Peer, header: SeamHeader, tensor: Tensor, *, timeout_s: float,
                      block: bool = False, after_send: Any = None) -> Frame:
        pair = self._pairs.get(peer.address)
        if pair is None:
            raise SeamError(f"no seam open to {peer.worker_id} at {peer.address} (lost, or never connected)")
        tensor, on_device = self._placed(pair, tensor)
        tag = pair.next_reply_tag()
        room = HEADER_BYTES + max(header.nbytes, ERROR_ROOM_BYTES)  # a reply has the request's shape, or is an error
        buffer = np.empty(room if room <= INLINE_BYTES else HEADER_BYTES + ERROR_ROOM_BYTES, dtype=np.uint8)
        timeout = timedelta(seconds=timeout_s)
        try:
            work = pair.post_receive(buffer, tag)
            pair.send(header, tensor, REQUEST_TAG, reply_tag=tag, on_device=on_device)
        except RuntimeError as exc:
            self._lose(pair, f"send failed: {exc}")
            raise SeamError(f"seam to {peer.worker_id} failed: {exc}") from None
        if after_send is not None:
            after_send()
        loop = self._loop
        assert loop is not None
        if not block:
            return await loop.run_in_executor(self._waiters, self._await_reply, pair, buffer, work, tag, timeout,
                                              False)
        pending = _Pending(pair, buffer, work, tag, timeout, loop.create_future())
        self._in_order.append(pending)
        self._drive_later()  # whatever else is ready runs first (another microbatch's attention)
        try:
            return await pending.future
        finally:
            self._settled -= pending.counted
            pending.counted = 0

    def _settle(self, pending: _Pending) -> None:
        """Wait (blocking) for one reply and hand it to its request (if that still waits)."""
        try:
            frame = self._await_reply(pending.pair, pending.buffer, pending.work, pending.tag, pending.timeout, True)
        except SeamError as exc:
            if not pending.future.done():
                pending.future.set_exception(exc)
                pending.counted = 1
        else:
            if not pending.future.done():
                pending.future.set_result(frame)
                pending.counted = 1
        self._settled += pending.counted

    def _drive_later(self) -> None:
        if not self._drive_scheduled and self._loop is not None:
            self._drive_scheduled = True
            self._loop.call_soon(self._drive)

    def _drive(self) -> None:
        """Once whatever is ready has run: wait for the oldest outstanding reply, unless a request whose
        reply is in has yet to run (then after it)."""
        self._drive_scheduled = False
        if not self._in_order:
            return
        if self._settled == 0:
            self._settle(self._in_order.popleft())
        if self._in_order:
            self._drive_later()

    def _await_reply(self, pair: Pair, buffer: np.ndarray, work: Any, tag: int, timeout: timedelta, on_loop: bool
                     ) -> Frame:
        try:
            header, tensor = pair.finish_receive(buffer, work, tag, timeout, copy=False)
        except Exception as exc:  # the peer died, hung past the timeout, or was dropped; a malformed reply
            reason = f"no reply: {exc}"
            if on_loop:
                self._lose(pair, reason)
            else:
                self._call(self._lose, pair, reason)
            raise SeamError(f"seam to {pair.peer.worker_id}: {reason}") from None
        return Frame(pair.peer, header, tensor)

    def _placed(self, pair: Pair, tensor: Tensor) -> tuple[Tensor, bool]:
        """The tensor as it travels: GPU to GPU when the pair has NCCL, else from host memory."""
        if not tensor.is_cuda:
            return tensor, False
        if pair.nccl is not None:
            return tensor, True
        if not self._warned_host_copy:
            log.info("seam to %s: CUDA tensors go through host memory on gloo (no NCCL pair)", pair.peer.worker_id)
            self._warned_host_copy = True
        return tensor.cpu(), False

    def _join(self, peer: Peer) -> Pair:
        """The attention side's rendezvous (blocking): a join number, then the group as rank 0."""
        url = urlsplit(peer.address)
        if url.scheme != "gloo" or not url.hostname or not url.port:
            raise SeamError(f"not a torch seam address: {peer.address!r}")
        store = TCPStore(url.hostname, url.port, world_size=None, is_master=False, timeout=STORE_CONNECT_TIMEOUT,
                         wait_for_workers=False)  # a dead peer's address is refused: fail in seconds, not minutes
        return self._build(peer, store, self._claim_join(store), 0, parse_qs(url.query).get("gpu", [""])[0])

    def _claim_join(self, store: Any) -> int:
        """The lowest free join number, taken and written in one step (`compare_set` on an absent key): no
        number is ever taken without saying who took it, so the acceptor waits on each number until it comes
        (TCPStore's libuv server, torch's default, wakes waiters on a `compare_set`)."""
        me = orjson.dumps({"worker_id": self.worker_id, "gpu": self.gpu_uuid, "nonce": uuid.uuid4().hex})
        number = 1
        while store.compare_set(f"aflex/join/{number}", "", me) != me:
            number += 1
        return number

    def _build(self, peer: Peer, store: Any, number: int, rank: int, peer_gpu: str) -> Pair:
        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [ProcessGroupGloo.create_device(hostname=self.host)]
        options._timeout = self.timeout
        gloo = ProcessGroupGloo(PrefixStore(f"aflex/pair/{number}", store), rank, 2, options)
        nccl = None
        if self.gpu_uuid and peer_gpu:
            if peer_gpu == self.gpu_uuid:
                log.warning("seam to %s: both halves on one GPU (%s): NCCL cannot pair a GPU with itself, so seam "
                            "tensors go through host memory on gloo", peer.worker_id, self.gpu_uuid)
            else:
                from torch.distributed.distributed_c10d import ProcessGroupNCCL

                nccl_options = ProcessGroupNCCL.Options()
                nccl_options._timeout = self.timeout
                torch.cuda.set_device(self.device)
                nccl = ProcessGroupNCCL(PrefixStore(f"aflex/pair/{number}/nccl", store), rank, 2, nccl_options)
        return Pair(peer, gloo, nccl, 1 - rank, self.device)

    # -- the FFN side: accept, receive, reply ---------------------------------------------------

    def _accept(self) -> None:
        """Build the group for each join, in join order; `close` wakes it with a key of its own."""
        store = self._store
        assert store is not None
        while True:
            joined = self._next_join
            key = f"aflex/join/{joined}"
            try:
                store.wait([key], JOIN_IDLE_WAIT)
            except Exception:
                if self._closing.is_set():
                    return
                try:
                    store.check([key])  # a quiet hour, or has the store itself failed?
                except Exception as exc:  # it failed: nobody can join any more
                    log.error("seam: the rendezvous store failed: %s", exc)
                    return
                continue
            if self._closing.is_set():
                return
            self._next_join += 1
            try:
                joiner = orjson.loads(store.get(key))
                peer = Peer(str(joiner["worker_id"]), f"accepted/{joined}")
                pair = self._build(peer, store, joined, 1, str(joiner.get("gpu", "")))
            except Exception as exc:
                log.warning("seam: join %d failed: %s", joined, exc)
                continue
            self._pairs[peer.address] = pair
            log.info("seam from %s accepted (%s)", peer.worker_id, "gloo + nccl" if pair.nccl is not None else "gloo")
            self._thread(lambda pair=pair: self._receive(pair), f"seam-recv-{peer.worker_id}")  # type: ignore[misc]

    def _receive(self, pair: Pair) -> None:
        """A pair's receiver thread: each request to `on_frame`, here, until the pair fails or closes."""
        buffer = np.empty(INLINE_BYTES, dtype=np.uint8)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            while True:
                work = pair.post_receive(buffer, REQUEST_TAG)
                header, tensor = pair.finish_receive(buffer, work, REQUEST_TAG, IDLE_WAIT, copy=True)
                try:
                    self.on_frame(Frame(pair.peer, header, tensor))
                except Exception:  # a handler's bug must not stop the frames after it
                    log.exception("seam: handling a frame from %s failed", pair.peer.worker_id)
        except Exception as exc:  # the peer died or hung up, a malformed frame, or we aborted the pair
            if not self._closing.is_set():
                self._call(self._lose, pair, f"seam receive failed: {exc}")

    def reply(self, request: Frame, header: SeamHeader, tensor: Tensor) -> None:
        pair = self._pairs.get(request.peer.address)
        if pair is None or pair.lost:
            log.debug("seam: reply to %s dropped (its seam is gone)", request.peer.worker_id)
            return
        tensor, on_device = self._placed(pair, tensor)
        try:
            pair.send(header, tensor, request.header.reply_tag, on_device=on_device)
        except RuntimeError as exc:  # the receiver thread sees the broken pair too, and reports it
            log.warning("seam: reply to %s failed: %s", request.peer.worker_id, exc)

    # -- loss and shutdown ----------------------------------------------------------------------

    def _lose(self, pair: Pair, reason: str) -> None:
        if self._pairs.get(pair.peer.address) is pair:
            del self._pairs[pair.peer.address]
        if pair.lost:
            return
        pair.abort()
        log.warning("seam to %s lost: %s", pair.peer.worker_id, reason)
        self.on_peer_lost(pair.peer, reason)

    def _wake_acceptor(self, port: int) -> None:
        client = TCPStore("127.0.0.1", port, world_size=None, is_master=False, timeout=self.timeout,
                          wait_for_workers=False)
        client.set(f"aflex/join/{self._next_join}", "{}")

    def drop(self, peer: Peer, reason: str) -> None:
        """Abort every pair to `peer.worker_id` (heard dead or hung): whatever waits on them fails now."""
        for pair in [p for p in self._pairs.values() if p.peer.worker_id == peer.worker_id]:
            self._lose(pair, reason)

    async def close(self) -> None:
        self._closing.set()
        if self._store is not None:  # wake the acceptor (its own store client is busy waiting)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._wake_acceptor, self._store.port)
        for pair in list(self._pairs.values()):
            pair.abort()
        self._pairs.clear()
        for thread in self._threads:
            await asyncio.to_thread(thread.join, 2.0)
        self._waiters.shutdown(wait=False, cancel_futures=True)
        self._store = None

    def _thread(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=with_torch_threads(target), name=name, daemon=True)  # it may compute
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(thread)
        thread.start()

    def _call(self, fn: Any, *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed between the check and the call
                loop.call_soon_threadsafe(fn, *args)

"""Who serves the FFN worker's queued frames, on which thread, and which frames share a forward.

Frames come in on the seam's receiving threads (one per attention worker on the torch seam). A
frame that finds the worker idle is served right there, on its receiving thread: no hand-off to
another thread, which would cost tens of microseconds on every hop. Frames that arrive while a
forward runs queue up; when that forward is done, a server thread of the worker's own takes over
the queue, so that every receiving thread goes back to receiving (and queueing) at once, and
frames of one layer from several attention workers meet in the queue and share a forward.

The merging rule (`take_batch`): the oldest frame, plus the oldest queued frame of its layer and
dtype from each *other* attention worker. Frames of one attention worker are never merged: they
are its pipelined microbatches, and answering them together would put them back in lockstep, so
that its attention and this FFN stop overlapping (measured on SmolLM2 at depth 2: 168 tok/s
merged, the same as depth 1).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from shared.torch_threads import with_torch_threads
from shared.transport.seam import Frame, Peer


@dataclass(frozen=True)
class Work:
    request: Frame  # from the attention worker to answer; its tensor is ffn_in [T, D] as it arrived

    @property
    def peer(self) -> Peer:
        return self.request.peer

    @property
    def layer(self) -> int:
        return self.request.header.layer

    @property
    def hidden(self) -> Tensor:
        return self.request.tensor


class ServingQueue:
    """The queue of frames waiting for an FFN forward, and the serving role (one thread at a time)."""

    def __init__(self, serve: Callable[[list[Work]], None], *, merge: bool) -> None:
        self.serve, self.merge = serve, merge
        self._queue: deque[Work] = deque()
        self._lock = threading.Condition()
        self._serving = False  # some thread holds the serving role
        self._handed_over = False  # the role waits for the server thread
        self._stopping = False
        self.idle = threading.Event()  # set while nothing is queued or being served
        self.idle.set()
        self._server = threading.Thread(target=with_torch_threads(self._server_loop), name="ffn-server", daemon=True)
        self._server.start()

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, work: Work) -> None:
        """Queue a frame (from a receiving thread); serve it here when nothing else is being served."""
        with self._lock:
            self._queue.append(work)
            self.idle.clear()
            if self._serving:
                return
            self._serving = True
            batch = self.take_batch()
        self.serve(batch)
        with self._lock:
            if self._queue:  # what queued meanwhile goes to the server thread; this one goes back to receiving
                self._handed_over = True
                self._lock.notify()
            else:
                self._release()

    def forget(self, peer: Peer) -> None:
        """Frames from a peer that is gone have nobody to go back to."""
        with self._lock:
            self._queue = deque(w for w in self._queue if w.peer != peer)

    def take_batch(self) -> list[Work]:
        """The oldest frame and its merge partners (see the module docstring); the caller holds the lock."""
        first = self._queue.popleft()
        batch = [first]
        if self.merge and self._queue:
            senders = {first.peer}
            rest: deque[Work] = deque()
            for work in self._queue:
                same = work.layer == first.layer and work.hidden.dtype == first.hidden.dtype
                if same and work.peer not in senders:
                    senders.add(work.peer)
                    batch.append(work)
                else:
                    rest.append(work)
            self._queue = rest
        return batch

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._server.join(5.0)

    def _server_loop(self) -> None:
        while True:
            with self._lock:
                while not self._handed_over and not self._stopping:
                    self._lock.wait()
                if not self._handed_over:
                    return
                self._handed_over = False
            while True:
                with self._lock:
                    if not self._queue:
                        self._release()
                        break
                    batch = self.take_batch()
                self.serve(batch)

    def _release(self) -> None:
        self._serving = False
        self.idle.set()

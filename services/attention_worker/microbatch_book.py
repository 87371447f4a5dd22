"""The attention worker's book of its microbatches, and of the sequences they hold.

A descriptor is *taken* when it arrives (its task not started yet), *entered* when its task starts
(the releases it carries applied, its sequences claimed as busy as they are admitted) and *left*
when it ends (its claims dropped, and the releases that came for its sequences meanwhile applied
now). `enter` is a context manager, so every descriptor that starts leaves exactly once, whatever
happens inside. Heartbeats read the book: what is in flight or taken, and the newest descriptor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from types import TracebackType

from shared.errors import AFlexError
from shared.messages import MicrobatchDescriptor

log = logging.getLogger("aflex.attention_worker")


class MicrobatchInFlightError(AFlexError):
    """A descriptor came again while its microbatch is still in flight here."""


class MicrobatchBook:
    """Which microbatches this worker has taken and has in flight, and which sequences they hold.

    `free` forgets a sequence and its KV (False when it is unknown). A release of a sequence that is
    busy in a microbatch waits until that microbatch leaves.
    """

    def __init__(self, worker_id: str, free: Callable[[str], bool]) -> None:
        self.worker_id = worker_id
        self._free = free
        self._taken: set[str] = set()  # descriptors received, their task not started yet
        self._in_flight: set[str] = set()
        self._busy: set[str] = set()  # sequences in an in-flight microbatch
        self._release_later: set[str] = set()  # released while busy: freed when their microbatch leaves
        self.newest_mb_id: str | None = None  # the newest descriptor taken (heartbeats say it)

    # -- the heartbeat's view -------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._in_flight)

    def active_mb_ids(self) -> list[str]:
        """In flight or taken: every microbatch that will still get its Done from this worker."""
        return sorted(self._in_flight | self._taken)

    def connection_dropped(self) -> None:
        """Descriptors sent meanwhile may be lost: heartbeats claim none taken until the next one comes."""
        self.newest_mb_id = None

    # -- a microbatch's life --------------------------------------------------------------------

    def take(self, mb_id: str) -> None:
        """A descriptor arrived; its task starts soon (`enter`)."""
        self.newest_mb_id = mb_id
        self._taken.add(mb_id)

    def enter(self, desc: MicrobatchDescriptor) -> MicrobatchEntry:
        """The descriptor's task starts: use as `with book.enter(desc) as entry:`."""
        return MicrobatchEntry(self, desc)

    def is_busy(self, seq_id: str) -> bool:
        """Whether the sequence is in a microbatch in flight (another one may not run it meanwhile)."""
        return seq_id in self._busy

    def release(self, seq_ids: Iterable[str]) -> None:
        """Free the sequences' KV now, or, for those busy in a microbatch, when it leaves."""
        for seq_id in seq_ids:
            if seq_id in self._busy:
                self._release_later.add(seq_id)
            elif not self._free(seq_id):
                log.debug("release of unknown sequence %s ignored", seq_id)

    def _leave(self, entry: MicrobatchEntry) -> None:
        self.release(entry.after_forks)
        if entry.in_flight:
            self._in_flight.discard(entry.mb_id)
        self._busy.difference_update(entry.claimed)
        later = [s for s in entry.claimed if s in self._release_later]
        self._release_later.difference_update(later)
        self.release(later)


class MicrobatchEntry:
    """One microbatch in the book, from its task's start to its end (a context manager).

    Entering applies the descriptor's releases, except those of sequences it forks: their blocks are
    shared with the forks, so they are released only when it leaves (unless the descriptor feeds that
    sequence again, a restart from 0, which must come after the release).
    """

    def __init__(self, book: MicrobatchBook, desc: MicrobatchDescriptor) -> None:
        self.book, self.mb_id = book, desc.mb_id
        forked = ({w.fork_of for w in desc.seqs if w.fork_of is not None} - {w.seq_id for w in desc.seqs}
                  if desc.release else set())
        self.now = [s for s in desc.release if s not in forked]
        self.after_forks = [s for s in desc.release if s in forked]
        self.in_flight = False  # counted in flight (a duplicate of one in flight never is)
        self.claimed: list[str] = []  # sequences this microbatch holds busy

    def __enter__(self) -> MicrobatchEntry:
        self.book._taken.discard(self.mb_id)
        try:
            self.book.release(self.now)
        except BaseException:
            self.book._leave(self)  # entered all the same: it leaves once
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.book._leave(self)

    def start(self) -> None:
        """Count the microbatch in flight; raises `MicrobatchInFlightError` if it already is."""
        if self.mb_id in self.book._in_flight:
            raise MicrobatchInFlightError(f"microbatch {self.mb_id} is already in flight on {self.book.worker_id}")
        self.book._in_flight.add(self.mb_id)
        self.in_flight = True

    def claim(self, seq_id: str) -> None:
        """The sequence is admitted into this microbatch: busy until it leaves."""
        self.book._busy.add(seq_id)
        self.claimed.append(seq_id)

"""Stop strings at the gateway, without torch.

`shared.model.sampling.StopStringMatcher` is the reference, but that module imports torch at the top and
the gateway installs without it; this is the same class. When the shared matcher moves to a torch-free
module, import it from there and delete this file.
"""

from __future__ import annotations

from shared.errors import InvalidRequestError


class StopStringMatcher:
    """Streams detokenized text while cutting it before the first stop string, as OpenAI does.

    The first stop string to *complete* wins (ties: the one starting earliest), which is the only
    rule a streaming matcher can follow, and it makes the output independent of how the text is
    split into deltas. A suffix that could still become a stop string is held back until it can't.
    """

    def __init__(self, stop: tuple[str, ...] | list[str] = ()) -> None:
        if any(not s for s in stop):
            raise InvalidRequestError("stop strings must be non-empty", "stop")
        self.stop = tuple(stop)
        self._max_hold_chars = max((len(s) for s in self.stop), default=1) - 1
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was hit); after a hit, emits nothing."""
        if self.stopped:
            return "", True
        if not self.stop:
            return delta, False
        buf = self._held + delta
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self.stop:
            start = buf.find(s)
            if start >= 0:
                cand = (start + len(s), start, s)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is not None:
            self.stopped = True
            self.matched = best[2]
            self._held = ""
            return buf[:best[1]], True
        hold = self._hold_length(buf)
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    def _hold_length(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        for n in range(min(len(buf), self._max_hold_chars), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def flush(self) -> str:
        """Release held-back text at the end of generation (nothing after a stop string was hit)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

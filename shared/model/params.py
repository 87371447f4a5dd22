"""Request-level sampling parameters and stop-string matching: pure Python, no torch.

The gateway validates requests and matches stop strings with these, and it installs without torch;
`sampling.py` (the torch side: per-sequence samplers and batched sampling) re-exports them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.errors import InvalidRequestError

# Below this temperature, logits / T overflows or is numerically greedy anyway: treat it as greedy.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20  # top alternatives per token, as vLLM's default `max_logprobs`


@dataclass(frozen=True)
class ValueRange:
    """The values a sampling parameter may take: declared once here, read by `SamplingParams.validate` and by
    the gateway's request schema (its pydantic bounds), so the two cannot disagree."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # (low, high] rather than [low, high]

    def holds(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        return above and (self.high is None or value <= self.high)

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


VALUE_RANGES = {
    "temperature": ValueRange(0.0, 2.0),
    "top_p": ValueRange(0.0, 1.0, low_open=True),
    "presence_penalty": ValueRange(-2.0, 2.0),
    "frequency_penalty": ValueRange(-2.0, 2.0),
    "repetition_penalty": ValueRange(0.0, 2.0, low_open=True),
    "top_k": ValueRange(low=-1),  # -1 and 0: off
    "max_tokens": ValueRange(low=1),
    "min_tokens": ValueRange(low=0),  # and at most max_tokens
    "logprobs": ValueRange(0, MAX_LOGPROBS),
}


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI-style sampling parameters of one request. Call `validate()` before using them.

    `top_k` of 0 or -1 means off; `temperature == 0` means greedy. Penalties follow OpenAI over the
    tokens generated so far: `logit -= presence_penalty * (count > 0) + frequency_penalty * count`.
    `min_tokens` tokens are generated before an EOS or a stop token id may be. `repetition_penalty`
    is vLLM's: every token already in the prompt or the output has its logit divided by it (if
    positive) or multiplied by it (if not). `logprobs` asks for each sampled token's log-probability
    and that many top alternatives; `prompt_logprobs` the same for the prompt's tokens (from the
    prefill's logits, the first token excepted). Both come from the model's raw logits.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: str | None = None  # structured outputs: an llguidance grammar the output must match (structured.py)

    def __post_init__(self) -> None:
        # Requests arrive as JSON: accept a single stop string and lists, store tuples (hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def has_repetition_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p cut the distribution (needs a sort of the vocabulary)."""
        return self.top_k > 1 or self.top_p < 1.0

    def validate(self) -> SamplingParams:
        """Raise `InvalidRequestError(message, param)` on the first out-of-range value; return self."""
        for name in ("top_k", "max_tokens", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be an integer, got {getattr(self, name)!r}", name)
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)):
                raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", name)
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value, allowed = getattr(self, name), VALUE_RANGES[name]
            if not allowed.holds(value):
                raise InvalidRequestError(f"{name} must be in {allowed}, got {value}", name)
        if not VALUE_RANGES["top_k"].holds(self.top_k):
            raise InvalidRequestError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k}",
                                      "top_k")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and VALUE_RANGES["logprobs"].holds(value)):
                raise InvalidRequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}", name)
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar):
            raise InvalidRequestError(f"grammar must be a non-empty string, got {self.grammar!r}", "grammar")
        if not VALUE_RANGES["max_tokens"].holds(self.max_tokens):
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        if not (VALUE_RANGES["min_tokens"].holds(self.min_tokens) and self.min_tokens <= self.max_tokens):
            raise InvalidRequestError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                                      f"got {self.min_tokens}", "min_tokens")
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}", "seed")
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                raise InvalidRequestError(f"stop_token_ids must be non-negative integers, got {token_id!r}",
                                          "stop_token_ids")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}", "stop")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}", "ignore_eos")
        return self


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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

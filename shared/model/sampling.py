"""Token sampling: request parameters, per-sequence sampler state, batched sampling, stop strings.

A sequence's tokens depend only on its own logits, parameters and seed, never on which other
sequences share its batch: each sequence owns its `torch.Generator`, and the code path a row takes
(greedy / full-vocab sampling / top-k-top-p sampling) is chosen from that row's parameters alone.
This is what makes a seeded request reproducible under continuous batching.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.errors import InvalidRequestError

# Below this temperature, logits / T overflows or is numerically greedy anyway: treat it as greedy.
GREEDY_TEMPERATURE_EPS = 1e-5
_SEED_MASK_64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI-style sampling parameters of one request. Call `validate()` before using them.

    `top_k` of 0 or -1 means off; `temperature == 0` means greedy. Penalties follow OpenAI over the
    tokens generated so far: `logit -= presence_penalty * (count > 0) + frequency_penalty * count`.
    `min_tokens` tokens are generated before an EOS or a stop token id may be.
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
    def truncates(self) -> bool:
        """Whether top-k or top-p cut the distribution (needs a sort of the vocabulary)."""
        return self.top_k > 1 or self.top_p < 1.0

    def validate(self) -> SamplingParams:
        """Raise `InvalidRequestError(message, param)` on the first out-of-range value; return self."""
        for name in ("top_k", "max_tokens", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be an integer, got {getattr(self, name)!r}", name)
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)):
                raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", name)
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError(f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k}",
                                      "top_k")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", name)
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        if not 0 <= self.min_tokens <= self.max_tokens:
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


class SequenceSampler:
    """Per-sequence sampling state: its own RNG, the counts of its generated tokens, its finish rule.

    Protocol per step: `token = sample_next_tokens(...)[i]`, then `reason = sampler.record(token)`
    (or, equivalently, `reason = sampler.finish_reason_after(token)` *before* `sampler.record(token)`).
    """

    def __init__(self, params: SamplingParams, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.params = params
        self.eos_token_ids = tuple(eos_token_ids)
        # Unseeded requests still get their own stream, so that they never perturb seeded ones.
        self.seed: int = params.seed if params.seed is not None else secrets.randbits(63)
        self.num_generated = 0
        self.token_counts: dict[int, int] = {}
        self.finish_reason: str | None = None
        self._stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(self.eos_token_ids)
        )
        self._generator: torch.Generator | None = None

    def generator(self, device: torch.device) -> torch.Generator:
        """The sequence's generator on `device`, created and seeded on first use there.

        If the logits ever move to another device the stream restarts from a seed mixed with the
        number of tokens generated so far, so that it stays deterministic for a given history.
        """
        gen = self._generator
        if gen is None or gen.device != device:
            seed = self.seed if gen is None else self.seed + 0x9E3779B9 * (self.num_generated + 1)
            gen = torch.Generator(device=device)
            gen.manual_seed(seed & _SEED_MASK_64)
            self._generator = gen
        return gen

    @property
    def masks_stop_tokens(self) -> bool:
        """While fewer than `min_tokens` are generated, EOS and stop token ids are forbidden."""
        return self.num_generated < self.params.min_tokens and bool(self._stop_ids)

    def banned_token_ids(self) -> frozenset[int]:
        return self._stop_ids if self.num_generated < self.params.min_tokens else frozenset()

    def finish_reason_after(self, token_id: int) -> str | None:
        """Why the sequence finishes if `token_id` is its next token (call before `record`), or None.

        "stop" for an EOS (unless `ignore_eos`) or a stop token id once `min_tokens` are generated;
        otherwise "length" when this token is the `max_tokens`-th.
        """
        if token_id in self._stop_ids and self.num_generated >= self.params.min_tokens:
            return "stop"
        if self.num_generated + 1 >= self.params.max_tokens:
            return "length"
        return None

    def record(self, token_id: int) -> str | None:
        """Count `token_id` as generated (for penalties and limits); return the finish reason, if any."""
        reason = self.finish_reason_after(token_id)
        self.num_generated += 1
        self.token_counts[token_id] = self.token_counts.get(token_id, 0) + 1
        if reason is not None and self.finish_reason is None:
            self.finish_reason = reason
        return reason


def apply_penalties_(logits: torch.Tensor, rows: Sequence[int], samplers: Sequence[SequenceSampler]) -> None:
    """In place: `logits[r, t] -= presence * (count > 0) + frequency * count` for each row in `rows`."""
    # logits: [B, V]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    amounts: list[float] = []
    for r in rows:
        p = samplers[r].params
        for tok, count in samplers[r].token_counts.items():
            row_idx.append(r)
            tok_idx.append(tok)
            amounts.append(p.presence_penalty + p.frequency_penalty * count)
    if not row_idx:
        return
    dev = logits.device
    index = (torch.tensor(row_idx, device=dev), torch.tensor(tok_idx, device=dev))
    logits.index_put_(index, -torch.tensor(amounts, dtype=logits.dtype, device=dev), accumulate=True)


def _mask_banned_(logits: torch.Tensor, rows: Sequence[int], samplers: Sequence[SequenceSampler]) -> None:
    # logits: [B, V]
    vocab = logits.shape[-1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for r in rows:
        for tok in samplers[r].banned_token_ids():
            if 0 <= tok < vocab:
                row_idx.append(r)
                tok_idx.append(tok)
    if row_idx:
        dev = logits.device
        logits[torch.tensor(row_idx, device=dev), torch.tensor(tok_idx, device=dev)] = -math.inf


def _top_k_top_p_probs(logits: torch.Tensor, top_k: list[int], top_p: list[float]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row descending and zero what top-k / top-p cut; return (probs, token ids), sorted.

    Top-p keeps the smallest prefix whose mass reaches `top_p` (always at least the top token).
    Sampling in sorted order saves scattering the probabilities back into vocabulary order.
    """
    # logits: [N, V] (already divided by temperature)
    vocab = logits.shape[-1]
    dev = logits.device
    sorted_logits, sorted_ids = torch.sort(logits, dim=-1, descending=True, stable=True)  # [N, V] x2
    rank = torch.arange(vocab, device=dev).unsqueeze(0)  # [1, V]
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=dev).unsqueeze(1)  # [N, 1]
    sorted_logits = sorted_logits.masked_fill(rank >= k, -math.inf)
    probs = torch.softmax(sorted_logits, dim=-1)  # [N, V]
    p = torch.tensor(top_p, dtype=probs.dtype, device=dev).unsqueeze(1)  # [N, 1]
    mass_before = torch.cumsum(probs, dim=-1) - probs  # [N, V]: mass of strictly higher-ranked tokens
    cut = (mass_before >= p) & (rank > 0)
    probs = probs.masked_fill(cut, 0.0)
    return probs, sorted_ids


def sample_next_tokens(logits: torch.Tensor, samplers: Sequence[SequenceSampler]) -> list[int]:
    """Sample one token per row of `logits` ([B, V], float) with each row's own sampler.

    Does not record the tokens (call `SequenceSampler.record`) and never modifies `logits`.
    """
    # logits: [B, V]
    if logits.dim() != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"logits must be [B, V] with B == len(samplers) == {len(samplers)}, "
                         f"got shape {list(logits.shape)}")
    batch = len(samplers)
    penalised = [i for i, s in enumerate(samplers) if s.params.has_penalties and s.token_counts]
    masked = [i for i, s in enumerate(samplers) if s.masks_stop_tokens]
    greedy = [i for i, s in enumerate(samplers) if s.params.is_greedy]

    if len(greedy) == batch and not penalised and not masked:  # fast path: one batched argmax
        return logits.argmax(dim=-1).tolist()

    work = logits.float()
    if penalised or masked:
        if work is logits:
            work = work.clone()
        apply_penalties_(work, penalised, samplers)
        _mask_banned_(work, masked, samplers)

    # One device tensor for the whole batch, read back once: a `.item()` per row would sync per row.
    dev = work.device
    out = torch.empty(batch, dtype=torch.long, device=dev)  # [B]
    if greedy:
        rows = torch.tensor(greedy, device=dev)
        out[rows] = work.index_select(0, rows).argmax(dim=-1)

    plain = [i for i, s in enumerate(samplers) if not s.params.is_greedy and not s.params.truncates]
    if plain:
        rows = torch.tensor(plain, device=dev)
        temps = torch.tensor([samplers[i].params.temperature for i in plain], device=dev)
        probs = torch.softmax(work.index_select(0, rows) / temps.unsqueeze(1), dim=-1)  # [N, V]
        out[rows] = _draw_rows(probs, [samplers[i] for i in plain])

    cut = [i for i, s in enumerate(samplers) if not s.params.is_greedy and s.params.truncates]
    if cut:
        rows = torch.tensor(cut, device=dev)
        temps = torch.tensor([samplers[i].params.temperature for i in cut], device=dev)
        scaled = work.index_select(0, rows) / temps.unsqueeze(1)  # [N, V]
        probs, sorted_ids = _top_k_top_p_probs(
            scaled, [samplers[i].params.top_k for i in cut], [samplers[i].params.top_p for i in cut]
        )
        picks = _draw_rows(probs, [samplers[i] for i in cut])  # [N], positions in sorted order
        out[rows] = sorted_ids.gather(1, picks.unsqueeze(1)).squeeze(1)
    return out.tolist()


def _draw_rows(probs: torch.Tensor, samplers: Sequence[SequenceSampler]) -> torch.Tensor:
    """One categorical draw per row, each from its own sequence's generator (no shared RNG state).

    This is `torch.multinomial(probs[j], 1, generator=g_j)` batched: multinomial draws one sample as
    `argmax(p / q)` with `q ~ Exp(1)` (bit-identical on CPU), so only the noise is made per row and the
    division and argmax run once for the batch. Tokens with probability 0 can never win.
    """
    # probs: [N, V], each row sums to 1 over its kept tokens -> [N] token positions
    noise = torch.empty_like(probs)  # [N, V]
    dev = probs.device
    for j, s in enumerate(samplers):
        noise[j].exponential_(generator=s.generator(dev))
    return (probs / noise).argmax(dim=-1)


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

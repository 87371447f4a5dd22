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

import torch

from shared.model.finish_rule import stop_token_ids
from shared.model.params import GREEDY_TEMPERATURE_EPS, SamplingParams, StopStringMatcher
from shared.model.structured import Constraint

__all__ = [
    "GREEDY_TEMPERATURE_EPS",
    "SamplingParams",
    "SequenceSampler",
    "StopStringMatcher",
    "sample_next_tokens",
]

_SEED_MASK_64 = (1 << 64) - 1
_SEED_STRIDE = 0x9E3779B97F4A7C15  # the n-th token's seed: seed + n * stride (golden-ratio stride)


class SequenceSampler:
    """Per-sequence sampling state: its own RNG, the counts of its generated tokens, its grammar.

    Protocol per step: `token = sample_next_tokens(...)[i]`, then `sampler.record(token)`. Whether the token
    ends the sequence is not the sampler's to say: the scheduler decides it in the mesh, the engine in
    process (`shared.model.finish_rule`); the sampler only keeps EOS and stop ids out of the draws that
    `min_tokens` forbids them (`banned_token_ids`).
    """

    def __init__(self, params: SamplingParams, eos_token_ids: tuple[int, ...] = (),
                 constraint: Constraint | None = None) -> None:
        self.params = params
        self.constraint = constraint  # structured outputs: the grammar's allowed tokens mask each draw
        self.eos_token_ids = tuple(eos_token_ids)
        # Unseeded requests still get their own stream, so that they never perturb seeded ones.
        self.seed: int = params.seed if params.seed is not None else secrets.randbits(63)
        self.num_generated = 0
        self.token_counts: dict[int, int] = {}
        self.seen_ids: set[int] = set()  # prompt and output tokens, for `repetition_penalty` (kept only then)
        self._stop_ids = stop_token_ids(params, self.eos_token_ids)
        self._generator: torch.Generator | None = None

    def generator(self, device: torch.device) -> torch.Generator:
        """The generator for the next token's draw, seeded from (seed, tokens generated so far).

        Counter-based, not one running stream: the noise of the n-th token depends only on the seed
        and n, so a sequence rebuilt elsewhere from its tokens (a lost worker's recompute, a request
        resubmitted to a new scheduler) draws what the first run would have drawn next.
        """
        gen = self._generator
        if gen is None or gen.device != device:
            gen = self._generator = torch.Generator(device=device)
        gen.manual_seed((self.seed + _SEED_STRIDE * self.num_generated) & _SEED_MASK_64)
        return gen

    @property
    def masks_stop_tokens(self) -> bool:
        """While fewer than `min_tokens` are generated, EOS and stop token ids are forbidden (not under a
        grammar: its mask lets EOS through only where the output is complete, and then it ends)."""
        return self.num_generated < self.params.min_tokens and bool(self._stop_ids) and self.constraint is None

    def banned_token_ids(self) -> frozenset[int]:
        return self._stop_ids if self.masks_stop_tokens else frozenset()

    def saw(self, token_ids: Sequence[int]) -> None:
        """Tokens fed to the sequence (its prompt, in one piece or chunk by chunk): `repetition_penalty` counts them."""
        if self.params.has_repetition_penalty:
            self.seen_ids.update(token_ids)

    def record(self, token_id: int) -> None:
        """Count `token_id` as generated: the penalties, the `min_tokens` mask and the grammar see it."""
        self.num_generated += 1
        self.token_counts[token_id] = self.token_counts.get(token_id, 0) + 1
        if self.params.has_repetition_penalty:
            self.seen_ids.add(token_id)
        if self.constraint is not None:
            self.constraint.consume(token_id)


def apply_penalties_(logits: torch.Tensor, rows: Sequence[int], samplers: Sequence[SequenceSampler]) -> None:
    """In place, as vLLM orders them: the repetition penalty over the prompt and output tokens (divide a
    positive logit by it, multiply a negative one), then `logits[r, t] -= presence * (count > 0) +
    frequency * count` over the output tokens, for each row in `rows`."""
    # logits: [B, V]
    for r in rows:
        penalty = samplers[r].params.repetition_penalty
        if penalty != 1.0 and samplers[r].seen_ids:
            ids = torch.tensor(sorted(samplers[r].seen_ids), device=logits.device)
            seen = logits[r, ids]
            logits[r, ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    row_idx: list[int] = []
    tok_idx: list[int] = []
    amounts: list[float] = []
    for r in rows:
        p = samplers[r].params
        if not p.has_penalties:
            continue
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


def _mask_grammar_(logits: torch.Tensor, rows: Sequence[int], samplers: Sequence[SequenceSampler]) -> None:
    """In place: -inf for every token the row's grammar cannot take next. A row the grammar and
    `min_tokens` together leave empty (the grammar is done, EOS still banned) keeps the grammar's tokens."""
    # logits: [B, V]
    if not rows:
        return
    vocab = logits.shape[-1]
    words = torch.empty(len(rows), (vocab + 31) // 32, dtype=torch.int32)  # [N, W] on the CPU: llguidance writes it
    for j, r in enumerate(rows):
        constraint = samplers[r].constraint
        assert constraint is not None
        constraint.fill_mask(words[j].data_ptr(), words.shape[1] * 4)
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()  # [N, V]
    allowed = allowed.to(logits.device)
    index = torch.tensor(list(rows), device=logits.device)
    masked = logits.index_select(0, index).masked_fill(~allowed, -math.inf)
    empty = torch.isinf(masked).all(dim=-1)  # [N]
    if bool(empty.any()):  # what the grammar allows, evenly: min_tokens cannot be kept inside it
        masked[empty] = torch.zeros_like(masked[empty]).masked_fill(~allowed[empty], -math.inf)
    logits.index_copy_(0, index, masked)


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
    penalised = [i for i, s in enumerate(samplers)
                 if (s.params.has_penalties and s.token_counts) or (s.params.has_repetition_penalty and s.seen_ids)]
    masked = [i for i, s in enumerate(samplers) if s.masks_stop_tokens]
    constrained = [i for i, s in enumerate(samplers) if s.constraint is not None and not s.constraint.failed]
    greedy = [i for i, s in enumerate(samplers) if s.params.is_greedy]

    if len(greedy) == batch and not penalised and not masked and not constrained:  # one batched argmax
        return logits.argmax(dim=-1).tolist()

    work = logits.float()
    if penalised or masked or constrained:
        if work is logits:
            work = work.clone()
        apply_penalties_(work, penalised, samplers)
        _mask_banned_(work, masked, samplers)
        _mask_grammar_(work, constrained, samplers)

    # One device tensor for the whole batch, read back once: a `.item()` per row would sync per row.
    dev = work.device
    out = torch.empty(batch, dtype=torch.long, device=dev)  # [B]
    if greedy:
        rows = torch.tensor(greedy, device=dev)
        out[rows] = work.index_select(0, rows).argmax(dim=-1)

    plain = [i for i, s in enumerate(samplers) if not s.params.is_greedy and not s.params.truncates]
    if plain:
        rows = torch.tensor(plain, device=dev)
        probs = torch.softmax(_tempered(work, plain, rows, samplers), dim=-1)  # [N, V]
        out[rows] = _draw_rows(probs, [samplers[i] for i in plain])

    cut = [i for i, s in enumerate(samplers) if not s.params.is_greedy and s.params.truncates]
    if cut:
        rows = torch.tensor(cut, device=dev)
        scaled = _tempered(work, cut, rows, samplers)  # [N, V]
        probs, sorted_ids = _top_k_top_p_probs(
            scaled, [samplers[i].params.top_k for i in cut], [samplers[i].params.top_p for i in cut]
        )
        picks = _draw_rows(probs, [samplers[i] for i in cut])  # [N], positions in sorted order
        out[rows] = sorted_ids.gather(1, picks.unsqueeze(1)).squeeze(1)
    return out.tolist()


def _tempered(work: torch.Tensor, picked: list[int], rows: torch.Tensor, samplers: Sequence[SequenceSampler]
              ) -> torch.Tensor:
    """The `picked` rows of `work` ([B, V]) over their temperatures: [N, V]. No gather when every row is
    picked, and no pass over the logits when every temperature is OpenAI's default 1 (dividing by 1 is exact)."""
    chosen = work if len(picked) == work.shape[0] else work.index_select(0, rows)  # [N, V]
    temps = [samplers[i].params.temperature for i in picked]
    if all(temp == 1.0 for temp in temps):
        return chosen
    return chosen / torch.tensor(temps, device=work.device).unsqueeze(1)


def _draw_rows(probs: torch.Tensor, samplers: Sequence[SequenceSampler]) -> torch.Tensor:
    """One categorical draw per row, each from its own sequence's generator (no shared RNG state).

    The exponential race `torch.multinomial` runs for one sample, `argmax(p / q)` with `q ~ Exp(1)`,
    batched: only the noise is made per row, as `q = -log u` from `uniform_` (16 rows of SmolLM2's
    49,152 tokens: 4.8 ms, against 16.8 ms with `exponential_`, measured). A race keeps a seeded draw
    when the logits move by rounding (a recompute after a fault, another batch's products): only a
    near-tie at the top can flip it. An inverse CDF (tried, 8239902) moves whenever the sum of all the
    probabilities before the pick does, and the fault tests' seeded streams caught it. Tokens with
    probability 0 can never win; a `u` of exactly 0 (2^-24 a token) only keeps its token from winning.
    """
    # probs: [N, V], each row sums to 1 over its kept tokens -> [N] token positions
    noise = torch.empty_like(probs)  # [N, V]
    dev = probs.device
    for j, s in enumerate(samplers):
        noise[j].uniform_(generator=s.generator(dev))
    noise.log_().neg_()  # Exp(1)
    return (probs / noise).argmax(dim=-1)

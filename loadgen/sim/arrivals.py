"""Request arrivals for the simulator: Azure LLM inference traces (2023) or synthetic Poisson/gamma."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import numpy as np

from loadgen.workloads import resolve_trace


@dataclass(frozen=True)
class Arrivals:
    time_s: np.ndarray  # sorted, from 0
    prompt: np.ndarray  # int
    output: np.ndarray  # int
    # int, per request: prompt tokens whose KV a prefix cache already holds (None: no reuse). The simulator
    # prefills only the rest, attending to the whole context, as the live attention worker does
    cached: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.time_s)

    def prefill_tokens(self, rid: int) -> int:
        """The prompt tokens request `rid` prefills: its prompt less its cached prefix."""
        return int(self.prompt[rid]) - (int(self.cached[rid]) if self.cached is not None else 0)


PREFIX_BLOCK_TOKENS = 16  # the live KV block: a cached prefix is whole blocks (shared/model/block_hash.py)


def with_prefix_reuse(arrivals: Arrivals, reuse: float, block_tokens: int = PREFIX_BLOCK_TOKENS) -> Arrivals:
    """`arrivals` with `reuse` of every prompt's tokens found in a prefix cache (vLLM's hit rate: cached
    prompt tokens / prompt tokens), in whole blocks and always leaving the last prompt token to compute, as
    the live worker does (it must run the pass that samples the first token). Why a rate: the Azure traces
    carry lengths, not token ids, so the reuse a workload has (multi-turn chat, agents, a shared system
    prompt) is a setting; a CSV with a CachedTokens column gives it per request instead."""
    if not 0.0 <= reuse < 1.0:
        raise ValueError(f"prefix reuse must be in [0, 1), got {reuse}")
    whole = np.floor(arrivals.prompt * reuse / block_tokens).astype(np.int64) * block_tokens
    cached = np.minimum(whole, np.maximum(arrivals.prompt - 1, 0) // block_tokens * block_tokens)
    return Arrivals(arrivals.time_s, arrivals.prompt, arrivals.output, cached)


def _parse_ts(text: str) -> float:
    text = text.strip()
    if "." in text:
        head, frac = text.split(".", 1)
        text = f"{head}.{frac[:6]}"
    return datetime.fromisoformat(text).timestamp()


def load_trace(name_or_path: str, time_scale: float = 1.0, window: tuple[float, float] | None = None,
               max_tokens: int | None = None, max_input_len: int | None = None,
               max_output_len: int | None = None) -> Arrivals:
    """`conv`, `code` or a CSV path (TIMESTAMP,ContextTokens,GeneratedTokens[,CachedTokens]). `time_scale` < 1
    compresses time (higher load); `window` keeps arrivals in [start, end) seconds of the (scaled) trace.
    `max_input_len` / `max_output_len` clip each request's lengths, as `aflex bench`'s flags of those names."""
    path = resolve_trace(name_or_path)
    ts, pr, out, cached = [], [], [], []
    with path.open() as fh:
        carries_cached = next(fh).strip().split(",")[3:4] == ["CachedTokens"]
        for line in fh:
            parts = line.strip().split(",")
            if len(parts) < 3 + carries_cached:
                continue
            ts.append(_parse_ts(parts[0]))
            pr.append(int(parts[1]))
            out.append(int(parts[2]))
            if carries_cached:
                cached.append(int(parts[3]))
    t = (np.array(ts) - ts[0]) * time_scale
    p = np.maximum(1, np.array(pr, dtype=np.int64))
    o = np.maximum(1, np.array(out, dtype=np.int64))
    if max_input_len:
        p = np.minimum(p, max_input_len)
    if max_output_len:
        o = np.minimum(o, max_output_len)
    if max_tokens:
        p = np.minimum(p, max_tokens - 1)
        o = np.minimum(o, np.maximum(1, max_tokens - p))
    c = np.clip(np.array(cached, dtype=np.int64), 0, p - 1) if carries_cached else None  # of the clipped prompt
    if window is not None:
        sel = (t >= window[0]) & (t < window[1])
        t, p, o = t[sel] - window[0], p[sel], o[sel]
        c = c[sel] if c is not None else None
    order = np.argsort(t, kind="stable")
    return Arrivals(t[order], p[order], o[order], c[order] if c is not None else None)


def synthetic(rate_rps: float, duration_s: float, seed: int, burstiness: float = 1.0,
              prompt_mean: float = 1024, output_mean: float = 256) -> Arrivals:
    """Gamma inter-arrivals (shape 1/burstiness², so CV = burstiness; 1 is Poisson), lognormal lengths."""
    rng = np.random.default_rng(seed)
    shape = 1.0 / max(burstiness, 1e-3) ** 2
    n = int(rate_rps * duration_s * 1.5) + 16
    gaps = rng.gamma(shape, 1.0 / (rate_rps * shape), n)
    t = np.cumsum(gaps)
    t = t[t < duration_s]
    k = len(t)
    sigma = 0.8
    prompt = np.maximum(1, rng.lognormal(np.log(prompt_mean) - sigma**2 / 2, sigma, k)).astype(np.int64)
    output = np.maximum(1, rng.lognormal(np.log(output_mean) - sigma**2 / 2, sigma, k)).astype(np.int64)
    return Arrivals(t, np.minimum(prompt, 16000), np.minimum(output, 4000))


LONG_CONTEXT_PROMPT = (8_000, 32_000)  # tokens: a retrieved document set, or an agent's accumulated context
LONG_CONTEXT_OUTPUT = (200, 1_000)  # tokens: an answer, a plan or a tool call with its reasoning


def long_context(rate_rps: float, duration_s: float, seed: int, burstiness: float = 1.0) -> Arrivals:
    """A synthetic agentic/RAG workload: Gamma inter-arrivals (CV = burstiness), prompts log-uniform over
    8-32K tokens and outputs over 200-1,000. Why these: retrieval-augmented and agent requests carry
    whole documents or a growing tool transcript (the Azure traces' prompts are ~1K), and answer at
    length; prefill then dominates the work, and decode reads a long KV per token, so attention, not the
    FFN, sets the decode step: the regime where per-operator clocks differ most."""
    rng = np.random.default_rng(seed)
    shape = 1.0 / max(burstiness, 1e-3) ** 2
    n = int(rate_rps * duration_s * 1.5) + 16
    t = np.cumsum(rng.gamma(shape, 1.0 / (rate_rps * shape), n))
    t = t[t < duration_s]
    k = len(t)

    def log_uniform(lo_hi: tuple[int, int]) -> np.ndarray:
        lo, hi = np.log(lo_hi[0]), np.log(lo_hi[1])
        return np.exp(rng.uniform(lo, hi, k)).astype(np.int64)
    return Arrivals(t, log_uniform(LONG_CONTEXT_PROMPT), log_uniform(LONG_CONTEXT_OUTPUT))

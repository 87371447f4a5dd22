"""Latency and energy predictors per (operator, phase), fitted from a GPU profile, corrected online.

The predictor never looks inside the roofline: it samples `operator_cost` (the emulated GPU, or any
backend with the same signature) over a grid of (tokens, context, clock) and fits, per clock and per
token bucket, a least-squares line in the operator's features:

- attention: [1, n, ctx, pairs]: n new tokens, ctx KV tokens read, pairs the attention score pairs
  (causal: a chunk of q tokens over a context of c sees q·c − q(q−1)/2 pairs; decode has pairs = ctx);
- ffn: [1, n].

Buckets are powers of two in n, so the kink of the roofline (weights-bound below the ridge,
FLOP-bound above; an MoE touching more experts) falls between lines, as in VoltanaLLM's EcoPred.
Energy is fitted the same way, so power is energy / time. Predictions come back as one array over
the fitted clock table, which is what the clock policy scans.

Online: `observe(...)` takes a measured time (and optionally energy) of one call and moves an EWMA
correction ratio per (operator, phase); every prediction is multiplied by it. Until an energy is
measured, the energy follows the time's ratio (the operator's power stays the model's).

`shard` divides an operator's work over GPUs (tensor parallelism: every GPU does 1/shard of the
flops and bytes); each shard value is fitted once and cached.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import overload

import numpy as np

from shared.gpu.base import OperatorWork
from shared.gpu.emulated import GPUProfile, operator_cost
from shared.gpu.workload import ComposedWork, _gemm, ffn_work, lm_head_work
from shared.kinds import CLOCK_PHASES
from shared.model.config import ModelArgs

OPS = ("attention", "ffn", "lm_head")
CostFn = Callable[[GPUProfile, OperatorWork, float], object]


def causal_pairs(q: float, ctx: float) -> float:
    """Attention score pairs of a chunk of `q` new tokens whose context (new tokens included) is `ctx`."""
    q = min(q, ctx)
    return q * ctx - q * (q - 1) / 2


def attention_core_work(args: ModelArgs, n_tokens: int, ctx_tokens: float, pairs: float, dtype_bytes: int = 2,
                        phase: str = "decode") -> OperatorWork:
    """The attention core of `attention_work_agg` (scores and values over the context, K/V written): the
    only part that depends on the context; the projections depend on the tokens alone."""
    flops = 4.0 * args.n_heads * args.head_dim * pairs
    moved = ctx_tokens * 2.0 * args.kv_dim * dtype_bytes + n_tokens * 2.0 * args.kv_dim * dtype_bytes
    moved += n_tokens * 2.0 * args.q_dim * dtype_bytes
    return OperatorWork(flops=flops, bytes_moved=moved, kind=f"attention.{phase}.core")


def attention_projections(args: ModelArgs, n_tokens: int, dtype_bytes: int = 2, phase: str = "decode") -> ComposedWork:
    """The QKV and output projections of `attention_work_agg`: the part that depends on the tokens alone."""
    kind = f"attention.{phase}"
    parts = (_gemm(f"{kind}.qkv", n_tokens, args.dim, args.q_dim + 2 * args.kv_dim, dtype_bytes),
             _gemm(f"{kind}.o", n_tokens, args.q_dim, args.dim, dtype_bytes))
    return ComposedWork(flops=sum(p.flops for p in parts), bytes_moved=sum(p.bytes_moved for p in parts),
                        kind=f"{kind}.projections", parts=parts)


def attention_work_agg(args: ModelArgs, n_tokens: float, ctx_tokens: float, pairs: float,
                       dtype_bytes: int = 2, phase: str = "decode") -> ComposedWork:
    """`shared.gpu.workload.attention_work` from aggregates (sum of contexts, sum of pairs), O(1).

    Equal to attention_work(args, n, contexts) when ctx = sum(contexts) and pairs = the sum of the
    causal pairs of each sequence's chunk (tests check it)."""
    n = max(1, round(n_tokens))
    qkv, out = attention_projections(args, n, dtype_bytes, phase).parts
    parts = (qkv, attention_core_work(args, n, ctx_tokens, pairs, dtype_bytes, phase), out)
    return ComposedWork(flops=sum(p.flops for p in parts), bytes_moved=sum(p.bytes_moved for p in parts),
                        kind=f"attention.{phase}", parts=parts)


@overload
def shard_work(work: ComposedWork, shard: int) -> ComposedWork: ...
@overload
def shard_work(work: OperatorWork, shard: int) -> OperatorWork: ...
def shard_work(work: OperatorWork, shard: int) -> OperatorWork:
    """The per-GPU share of `work` split over `shard` GPUs (tensor parallel), each part divided."""
    if shard <= 1:
        return work
    if not isinstance(work, ComposedWork):
        return OperatorWork(work.flops / shard, work.bytes_moved / shard, work.kind)
    parts = tuple(OperatorWork(p.flops / shard, p.bytes_moved / shard, p.kind) for p in (work.parts or (work,)))
    return ComposedWork(flops=work.flops / shard, bytes_moved=work.bytes_moved / shard, kind=work.kind, parts=parts)


def op_work(args: ModelArgs, op: str, phase: str, n: float, ctx: float = 0.0, pairs: float = 0.0,
            shard: int = 1) -> ComposedWork:
    """One layer's work of `op` ("attention", "ffn" or "lm_head") on one GPU of a `shard`-way split."""
    n_int = max(1, round(n))
    if op == "attention":
        w = attention_work_agg(args, n_int, ctx, pairs, phase=phase)
    elif op == "ffn":
        w = ffn_work(args, n_int, phase=phase)
    elif op == "lm_head":
        w = lm_head_work(args, n_int)
    else:
        raise ValueError(f"unknown operator {op!r}")
    return shard_work(w, shard)


def _features(op: str, n: np.ndarray, ctx: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    n = np.asarray(n, dtype=float)
    if op == "attention":
        return np.stack([np.ones_like(n), n, np.asarray(ctx, float) / 1e3, np.asarray(pairs, float) / 1e6], axis=-1)
    return np.stack([np.ones_like(n), n], axis=-1)


BUCKET_EDGES = np.array([2.0**k for k in range(0, 16)])  # 1, 2, 4, ... 32768 tokens


def _bucket(n: np.ndarray | float) -> np.ndarray:
    return np.clip(np.searchsorted(BUCKET_EDGES, np.asarray(n, float), side="right") - 1, 0, len(BUCKET_EDGES) - 2)


_EDGES = BUCKET_EDGES.tolist()


def _bucket_of(n: float) -> int:
    """`_bucket` of one scalar, without numpy's per-call overhead (the clock policy's hot path)."""
    return min(max(bisect.bisect_right(_EDGES, n) - 1, 0), len(_EDGES) - 2)


def _grid(op: str, phase: str, rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sample points (n, ctx, pairs) for one (op, phase): log-uniform tokens, realistic contexts."""
    if phase == "decode" or op == "lm_head":
        n = np.round(np.exp(rng.uniform(0, np.log(1024), size)))
        per_seq = np.exp(rng.uniform(np.log(32), np.log(12000), size))
        ctx = n * per_seq
        pairs = ctx.copy()
    else:
        n = np.round(np.exp(rng.uniform(np.log(8), np.log(32768), size)))
        prefix = np.where(rng.uniform(size=size) < 0.5, 0.0, np.exp(rng.uniform(np.log(16), np.log(8000), size)))
        n_seq = np.maximum(1, np.round(np.exp(rng.uniform(0, np.log(16), size))))
        q = n / n_seq
        c = q + prefix
        ctx = np.asarray(n_seq * c, dtype=np.float64)
        pairs = np.asarray(n_seq * (q * c - q * (q - 1) / 2), dtype=np.float64)
    return n, ctx, pairs


_FITTING = threading.Lock()  # one fit at a time in a process (fits are few: one per op, phase and shard)


@dataclass
class _Fit:
    time: np.ndarray  # (clocks, buckets, features)
    energy: np.ndarray


@dataclass
class Predictor:
    """Time (s) and energy (J) of one layer's attention or FFN per GPU, over a clock table."""

    profile: GPUProfile
    args: ModelArgs
    clocks: np.ndarray  # MHz, ascending: the table predictions are made over
    samples: int = 400
    seed: int = 0
    alpha: float = 0.2  # EWMA weight of one observation
    cost_fn: CostFn = operator_cost
    _fits: dict[tuple[str, str, int], _Fit] = field(default_factory=dict)
    correction: dict[tuple[str, str], float] = field(default_factory=dict)
    energy_correction: dict[tuple[str, str], float] = field(default_factory=dict)
    idle_table: np.ndarray = field(init=False, repr=False)  # context-idle power (W) of one GPU per clock

    def __post_init__(self) -> None:
        self.idle_table = self.profile.context_idle_table(self.clocks)

    @classmethod
    def for_profile(cls, profile: GPUProfile, args: ModelArgs, clock_step_mhz: int = 45, **kw: object) -> Predictor:
        clocks = np.array(sorted({*range(profile.min_mhz, profile.max_mhz + 1, clock_step_mhz), profile.max_mhz}),
                          dtype=float)
        return cls(profile=profile, args=args, clocks=clocks, **kw)  # type: ignore[arg-type]

    # -- ground truth sampling ----------------------------------------------------------------
    def measure(self, op: str, phase: str, n: float, ctx: float, pairs: float, clock: float,
                shard: int = 1) -> tuple[float, float]:
        cost = self.cost_fn(self.profile, op_work(self.args, op, phase, n, ctx, pairs, shard), clock)
        return float(cost.time_s), float(cost.time_s * cost.power_w)  # type: ignore[attr-defined]

    def warm(self, shard: int = 1) -> None:
        """Fit every (op, phase) now (each fit is lazy, and all take ~0.6 s: the scheduler's first
        request would wait for them on its event loop)."""
        for op in OPS:
            for phase in CLOCK_PHASES:
                self._fit(op, phase, shard)

    def _fit(self, op: str, phase: str, shard: int) -> _Fit:
        key = (op, phase, shard)
        fit = self._fits.get(key)
        if fit is not None:
            return fit
        with _FITTING:  # a caller that meets a fit under way on another thread waits for it, not redoes it
            fit = self._fits.get(key)
            if fit is None:
                fit = self._fits[key] = self._fit_now(op, phase, shard)
        return fit

    def _fit_now(self, op: str, phase: str, shard: int) -> _Fit:
        rng = np.random.default_rng(self.seed + 7919 * OPS.index(op) + 104729 * CLOCK_PHASES.index(phase))
        n, ctx, pairs = _grid(op, phase, rng, self.samples if op == "attention" else max(60, self.samples // 4))
        x = _features(op, n, ctx, pairs)
        b = _bucket(n)
        n_b = len(BUCKET_EDGES) - 1
        t_coef = np.zeros((len(self.clocks), n_b, x.shape[1]))
        e_coef = np.zeros_like(t_coef)
        for ci, f in enumerate(self.clocks):
            te = np.array([self.measure(op, phase, n[i], ctx[i], pairs[i], f, shard) for i in range(len(n))])
            for bi in range(n_b):
                sel = b == bi
                if not sel.any():
                    near = np.argsort(np.abs(np.log2(np.maximum(n, 1)) - bi))[: max(8, x.shape[1] * 2)]
                    sel = np.zeros(len(n), bool)
                    sel[near] = True
                # relative least squares: weight rows by 1/t so percentage errors are balanced
                w = 1.0 / te[sel, 0]
                t_coef[ci, bi] = np.linalg.lstsq(x[sel] * w[:, None], te[sel, 0] * w, rcond=None)[0]
                we = 1.0 / te[sel, 1]
                e_coef[ci, bi] = np.linalg.lstsq(x[sel] * we[:, None], te[sel, 1] * we, rcond=None)[0]
        return _Fit(t_coef, e_coef)

    # -- prediction ---------------------------------------------------------------------------
    def predict(self, op: str, phase: str, n: float, ctx: float = 0.0, pairs: float = 0.0,
                shard: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(time_s, energy_j) arrays over `self.clocks` for one layer's `op` on one GPU."""
        fit = self._fits.get((op, phase, shard)) or self._fit(op, phase, shard)
        bi = _bucket_of(n)
        x = np.array((1.0, n, ctx / 1e3, pairs / 1e6) if op == "attention" else (1.0, n))  # as _features
        t = np.maximum(fit.time[:, bi, :] @ x, 1e-7) * self.correction.get((op, phase), 1.0)
        # no measured energy yet: an operator that runs k times longer than modelled draws the model's power
        # k times as long (a time correction alone would price a slow GPU's power as if it fell)
        key = (op, phase)
        e = np.maximum(fit.energy[:, bi, :] @ x, 1e-9) * self.energy_correction.get(key, self.correction.get(key, 1.0))
        return t, e

    def predict_at(self, op: str, phase: str, n: float, ctx: float, pairs: float, clock: float,
                   shard: int = 1) -> float:
        t, _ = self.predict(op, phase, n, ctx, pairs, shard)
        return float(np.interp(clock, self.clocks, t))

    def power_w(self, op: str, phase: str, n: float, ctx: float = 0.0, pairs: float = 0.0,
                shard: int = 1) -> np.ndarray:
        t, e = self.predict(op, phase, n, ctx, pairs, shard)
        return e / t

    # -- online correction --------------------------------------------------------------------
    def observe(self, op: str, phase: str, n: float, ctx: float, pairs: float, clock: float,
                measured_s: float, measured_j: float | None = None, shard: int = 1) -> float:
        """Fold one measured call into the EWMA correction; returns the new time ratio."""
        fit = self._fit(op, phase, shard)
        bi = int(_bucket(n))
        x = _features(op, np.array(n, float), np.array(ctx, float), np.array(pairs, float))
        raw_t = float(np.interp(clock, self.clocks, np.maximum(fit.time[:, bi, :] @ x, 1e-7)))
        key = (op, phase)
        r = self.correction.get(key, 1.0)
        r = (1 - self.alpha) * r + self.alpha * (measured_s / raw_t)
        self.correction[key] = r
        if measured_j is not None:
            raw_e = float(np.interp(clock, self.clocks, np.maximum(fit.energy[:, bi, :] @ x, 1e-9)))
            re = self.energy_correction.get(key, 1.0)
            self.energy_correction[key] = (1 - self.alpha) * re + self.alpha * (measured_j / raw_e)
        return r


@cache
def cached_predictor(profile: GPUProfile, args: ModelArgs, clock_step_mhz: int = 45) -> Predictor:
    """One fitted predictor per (profile, model) per process."""
    return Predictor.for_profile(profile, args, clock_step_mhz)

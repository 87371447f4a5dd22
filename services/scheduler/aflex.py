"""The live scheduler's `aflex` policy: shared/policy's clock selection and batching rules on its own load.

Pure (no I/O, no clock of its own): the governor feeds it what the mesh ran and observed, and sends
what it answers. Per window it plans each attention worker's (depth, attention clock, FFN clock) for
each phase with `choose_operating_point` on the window's 90th-percentile iteration, under the SLO
margins; it caps prefill tokens per iteration (`prefill_tokens`); it corrects its predictors online
from `MicrobatchDone` timings, within a band. docs/architecture.md ("The aflex policy, live") has
the budgets, the batching rule and the correction in full.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shared.gpu.emulated import GPUProfile
from shared.messages import ClockPhase
from shared.model.config import ModelArgs
from shared.perf import Predictor, cached_predictor, causal_pairs
from shared.policy import (
    AFLEX_BATCHING,
    SHARED_CLOCK_OBJECTIVE,
    BatchingRule,
    BatchStats,
    ClockRule,
    OperatingPoint,
    PoolShape,
    PrefillQuery,
    SloMargin,
    choose_operating_point,
    prefill_order,
)
from shared.policy.decode_slack import iteration_budget_s
from shared.policy.pipeline import seam_transfer_s
from shared.policy.prefill_cap import AT_MAX, prefill_cap, queue_ttft_budget

# The simulator's `aflex` policy, one definition (`shared.policy.specs`): shortest-prompt-first prefill
# with aging, prefill iterations capped by the SLOs, decode clocks scored by energy above the idle floor,
# each worker's decode budget its running requests' banked TPOT (`shared.policy.decode_slack`).
# The clock depths are the scheduler's (`microbatch_depth`).
BATCHING = AFLEX_BATCHING
CLOCK_OBJECTIVE = SHARED_CLOCK_OBJECTIVE


def serving_order(now_mono: float, queue: Sequence[tuple[float, float]],
                  rule: BatchingRule = BATCHING, priority: Sequence[int] | None = None) -> list[int]:
    """Indices of `queue` ((arrival, prefill tokens left) per request, in queue order) in the order the
    policy serves them: `prefill_order` at `now_mono` (arrival on the same clock), `priority` first."""
    return prefill_order(rule, now_mono, [a for a, _ in queue], [r for _, r in queue], priority)


@dataclass(frozen=True)
class IterationSample:
    """One iteration of one attention worker, as the scheduler planned it."""

    mono: float  # time.monotonic() when it was sent
    phase: ClockPhase  # "prefill" when any prefill chunk is in it (mixed runs prefill clocks)
    n_tokens: int
    ctx_tokens: float
    pairs: float
    n_sample: int
    n_decode: int  # decode sequences in it
    max_prompt: int  # longest prompt among its prefill passes (0: none)
    depth: int = 1
    n_seqs: int = 0  # sequences in it (0: not recorded)
    chunk: tuple[float, float, float] = (0.0, 0.0, 0.0)  # its largest pass: (new tokens, context, pairs)

    @property
    def stats(self) -> BatchStats:
        return BatchStats(self.phase, float(self.n_tokens), self.ctx_tokens, self.pairs, float(self.n_sample),
                          *self.chunk, n_seqs=float(self.n_seqs))


def sample_of(passes: Iterable[tuple[int, int, bool, bool, int]], mono: float, depth: int = 1) -> IterationSample:
    """An `IterationSample` from (n_new, start, samples, is_decode, prompt_len) per pass."""
    n = n_dec = n_smp = max_prompt = count = 0
    ctx = pairs = 0.0
    chunk = (0.0, 0.0, 0.0)
    for n_new, start, samples, is_decode, prompt_len in passes:
        c = start + n_new
        count += 1
        n += n_new
        ctx += c
        p = causal_pairs(n_new, c)
        pairs += p
        n_smp += samples
        n_dec += is_decode
        if not is_decode:
            max_prompt = max(max_prompt, prompt_len)
        if n_new > chunk[0]:
            chunk = (float(n_new), float(c), float(p))
    phase: ClockPhase = "decode" if n_dec == count else "prefill"
    return IterationSample(mono, phase, n, ctx, pairs, n_smp, n_dec, max_prompt, depth, count, chunk)


def representative(samples: Sequence[IterationSample], phase: ClockPhase) -> IterationSample | None:
    """The window's iteration of `phase` at the 90th percentile of batch tokens (None: none ran)."""
    xs = sorted((s for s in samples if s.phase == phase), key=lambda s: (s.n_tokens, s.ctx_tokens))
    if not xs:
        return None
    return xs[min(len(xs) - 1, math.ceil(0.9 * len(xs)) - 1)]


@dataclass(frozen=True)
class PairPlan:
    """What `plan_pair` decided for one attention worker and phase, and everything it decided from."""

    phase: ClockPhase
    stats: BatchStats
    budget_s: float
    shape: PoolShape
    rule: ClockRule
    current: OperatingPoint | None
    op: OperatingPoint


class AflexPlanner:
    def __init__(self, args: ModelArgs, *, ttft_slo_ms: float, tpot_slo_ms: float, depths: tuple[int, ...],
                 link_bytes_s: float = 400e9, max_batch_tokens: int = 2048, observe_band: float = 0.5,
                 max_correction: float = 4.0) -> None:
        self.args = args
        self.ttft_slo_ms, self.tpot_slo_ms = ttft_slo_ms, tpot_slo_ms
        self.rule = ClockRule(depths=depths, objective=CLOCK_OBJECTIVE)
        self.batching = BATCHING
        self.link_bytes_s = link_bytes_s
        self.max_batch_tokens = max_batch_tokens
        self.observe_band = observe_band
        self.max_correction = max_correction
        self.margins: dict[ClockPhase, SloMargin] = {"prefill": SloMargin(), "decode": SloMargin()}
        self._predictors: dict[GPUProfile, Predictor] = {}

    def predictor(self, profile: GPUProfile) -> Predictor:
        """This planner's predictor for a `GPUProfile`: the shared fit, its own online correction."""
        pred = self._predictors.get(profile)
        if pred is None:
            base = cached_predictor(profile, self.args)
            pred = dataclasses.replace(base, correction={}, energy_correction={})  # fits shared, not corrections
            self._predictors[profile] = pred
        return pred

    def warm(self, profile: GPUProfile) -> None:
        """Fit the predictor's tables for `profile` now (blocking, ~0.6 s the first time): the scheduler calls
        it when a worker registers, so that no request waits for the fits."""
        self.predictor(profile).warm()

    # -- margins -----------------------------------------------------------------------------------
    def update_margins(self, observed: dict[ClockPhase, tuple[float | None, int, int]]) -> None:
        """Fold one window's (p90 ms, misses, observations) per phase into the margins."""
        slos: dict[ClockPhase, float] = {"prefill": self.ttft_slo_ms, "decode": self.tpot_slo_ms}
        for phase, slo in slos.items():
            p90, misses, count = observed.get(phase, (None, 0, 0))
            if p90 is None and misses:
                p90 = slo * 1.01  # only late requests that have not produced a value yet: a miss all the same
            self.margins[phase].update(p90, slo, misses / max(count, 1))

    # -- budgets -----------------------------------------------------------------------------------
    def budget_s(self, phase: ClockPhase, rep: IterationSample, now_unix: float = 0.0,
                 queue: Sequence[tuple[float, float]] = (), banked_s: float = 0.0) -> float:
        """The per-iteration latency budget of `phase`; `queue`: (arrival unix ts, prefill tokens) waiting;
        `banked_s`: the least `decode_slack.allowance_s` of the worker's running requests (0: none)."""
        tpot_b = self.margins["decode"].budget(self.tpot_slo_ms / 1e3)
        if self.batching.decode_slack and banked_s > 0:
            tpot_b = iteration_budget_s(tpot_b, banked_s, self.ttft_slo_ms / 1e3)
        if phase == "decode":
            return tpot_b
        ttft_b = self.margins["prefill"].budget(self.ttft_slo_ms / 1e3)
        chunk = float(max(1, min(rep.n_tokens, self.max_batch_tokens)))
        # a fresh request with the window's longest prompt leads the queue
        budget = queue_ttft_budget(now_unix, queue, ttft_b, chunk, lead_tokens=float(max(rep.max_prompt, 1)))
        return min(budget, tpot_b) if rep.n_decode else budget

    # -- planning ----------------------------------------------------------------------------------
    def plan_pair(self, profile: GPUProfile, phase: ClockPhase, samples: Sequence[IterationSample],
                  share: int = 1, now_unix: float = 0.0, queue: Sequence[tuple[float, float]] = (),
                  current: OperatingPoint | None = None, colocated: bool = False,
                  banked_s: float = 0.0) -> PairPlan | None:
        """The operating point of one attention worker (and `share` like it per FFN worker) for `phase`;
        `colocated`: a worker running both halves itself (one clock, no FFN worker, no hop); `banked_s`:
        as in `budget_s`."""
        rep = representative(samples, phase)
        if rep is None:
            return None
        pred = self.predictor(profile)
        k = 1 if colocated else max(1, share)
        shape = PoolShape(split=False, link_bytes_s=self.link_bytes_s) if colocated else \
            PoolShape(split=True, attention=k, ffn=1, link_bytes_s=self.link_bytes_s)
        s = rep.stats
        stats = BatchStats(s.phase, s.n_tokens * k, s.ctx_tokens * k, s.pairs * k, s.n_sample * k,
                           s.seq_tokens, s.seq_ctx, s.seq_pairs, s.n_seqs * k)  # a sequence stays on one worker
        budget = self.budget_s(phase, rep, now_unix, queue, banked_s)
        op = choose_operating_point(pred, shape, stats, budget, self.rule, current)
        return PairPlan(phase, stats, budget, shape, self.rule, current, op)

    # -- prefill cap -------------------------------------------------------------------------------
    def _time_at_max(self, profile: GPUProfile, stats: BatchStats, share: int) -> float:
        """Predicted time at the top clocks of an iteration of `stats` (`share` as in `plan_pair`)."""
        shape = PoolShape(split=True, attention=max(1, share), ffn=1, link_bytes_s=self.link_bytes_s)
        return choose_operating_point(self.predictor(profile), shape, stats, 0.0, AT_MAX).time_s

    def prefill_tokens(self, profile: GPUProfile, query: PrefillQuery, share: int = 1) -> int:
        """Prefill tokens for one iteration of one attention worker (`shared.policy.prefill_cap`), priced on
        its GPU `profile` with `share` attention workers per FFN worker (as in `plan_pair`)."""
        return prefill_cap(self.batching, query, lambda stats: self._time_at_max(profile, stats, share), share=share,
                           tpot_budget_s=self.margins["decode"].budget(self.tpot_slo_ms / 1e3),
                           ttft_slo_s=self.ttft_slo_ms / 1e3)

    # -- online correction -------------------------------------------------------------------------
    def observe(self, profile: GPUProfile, phase: ClockPhase, sample: IterationSample, *, attention_s: float,
                ffn_wait_s: float, clock_attention: float | None, clock_ffn: float | None, lone: bool,
                ffn_compute_s: float = 0.0) -> None:
        """Correct the predictors from one microbatch's timings (whole-model seconds, all layers).

        FFN: the FFN worker's own compute time when reported; else, for a lone microbatch (nothing
        queued beside it), the wait less the modelled seam transfer."""
        pred = self.predictor(profile)
        layers = max(1, self.args.n_layers)
        n, ctx, pairs = float(sample.n_tokens), sample.ctx_tokens, sample.pairs
        if attention_s > 0 and clock_attention is not None:
            self._observe(pred, "attention", phase, n, ctx, pairs, clock_attention, attention_s / layers)
        if clock_ffn is None:
            return
        measured = 0.0
        if ffn_compute_s > 0:
            measured = ffn_compute_s / layers
        elif lone and ffn_wait_s > 0:
            measured = ffn_wait_s / layers - 2.0 * seam_transfer_s(n, self.args.dim, self.link_bytes_s)
        if measured > 0:
            self._observe(pred, "ffn", phase, n, 0.0, 0.0, clock_ffn, measured)

    def _observe(self, pred: Predictor, op: str, phase: ClockPhase, n: float, ctx: float, pairs: float,
                 clock: float, measured_s: float) -> None:
        ratio = pred.correction.get((op, phase), 1.0)
        raw = pred.predict_at(op, phase, n, ctx, pairs, clock) / ratio
        lo, hi = ratio * (1.0 - self.observe_band), ratio * (1.0 + self.observe_band)
        r = pred.observe(op, phase, n, ctx, pairs, clock, min(max(measured_s, raw * lo), raw * hi))
        pred.correction[(op, phase)] = min(max(r, 1.0 / self.max_correction), self.max_correction)

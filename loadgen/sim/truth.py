"""The simulator's ground truth: an iteration's time and energy on the emulated GPU at the chosen clocks.

The policy decides from the *predictors*; what the iteration then costs comes from here, from
`operator_cost` of the emulated profile through the same pipeline formulas (shared.policy.pipeline).
"""

from __future__ import annotations

from shared.gpu.emulated import GPUProfile, operator_cost
from shared.model.config import ModelArgs
from shared.perf import attention_core_work, attention_projections, op_work, shard_work
from shared.policy import BatchStats, PoolShape
from shared.policy.pipeline import iteration_cost


class IterationTruth:
    """`cost` memoises the token-only operators per (operator, phase, tokens, shard, clock)."""

    def __init__(self, profile: GPUProfile, args: ModelArgs) -> None:
        self.profile, self.args = profile, args
        self._memo: dict[tuple[str, str, int, int, float], tuple[float, float]] = {}

    def cost(self, shape: PoolShape, s: BatchStats, depth: int, fa: float, ff: float) -> tuple[float, float]:
        """True (time, energy) from the emulated GPU at the chosen clocks (the same pipeline formulas).

        Plain floats throughout, and the token-only operators (FFN, LM head, attention projections) looked up once per
        (phase, tokens, shard, clock): the same figures, without the per-iteration cost of rebuilding them."""
        a, p, memo = self.args, self.profile, self._memo
        fa, ff = float(fa), float(ff)  # clocks may come from a numpy table

        def att(n: float, ctx: float, pairs: float, shard: int) -> tuple[float, float]:
            # the projections (tokens only) looked up, the context-dependent core computed: the parts of
            # one operator run one after another, so their times and energies add
            n_int = max(1, round(n))
            t_proj, e_proj = tokens_only("attention", n, shard, fa)
            c = operator_cost(p, shard_work(attention_core_work(a, n_int, ctx, pairs, phase=s.phase), shard), fa)
            return t_proj + c.time_s, e_proj + c.time_s * c.power_w

        def tokens_only(op: str, n: float, shard: int, clock_mhz: float) -> tuple[float, float]:
            key = (op, s.phase, max(1, round(n)), shard, clock_mhz)
            hit = memo.get(key)
            if hit is None:
                work = shard_work(attention_projections(a, key[2], phase=s.phase), shard) if op == "attention" \
                    else op_work(a, op, s.phase, n, 0, 0, shard)  # attention: its projections (`att` adds the core)
                c = operator_cost(p, work, clock_mhz)
                hit = memo[key] = (c.time_s, c.time_s * c.power_w)
            return hit

        def ffn(n: float, shard: int) -> tuple[float, float]:
            return tokens_only("ffn", n, shard, ff if shape.split else fa)

        def head(n: float, shard: int) -> tuple[float, float]:
            return tokens_only("lm_head", n, shard, fa)

        idle_a = p.context_idle_power_at(fa)
        idle_f = p.context_idle_power_at(ff) if shape.split else idle_a
        t, e = iteration_cost(att, ffn, head, shape, s, depth, a.dim, a.n_layers, idle_a, idle_f)  # type: ignore[arg-type]
        return float(t), float(e)

"""The simulator's AFlex pipelines only what the live scheduler can: microbatches are cut between
sequences (`split_microbatches`), never inside one, so a group's depth is at most its sequence count
and one prompt's tokens never overlap each other's hops (issue 38, correction 1).

The planner (`point_tables`, which the live governor and the simulator's controller both call) and the
pipeline cost (`iteration_cost`, the simulator's truth and the planner's prediction) are checked against
a direct reckoning of the microbatches the live cut makes of the same iteration.
"""

from __future__ import annotations

from typing import Any

import pytest

from loadgen.sim.models import get_model
from shared.gpu.emulated import load_profile
from shared.perf import Predictor, cached_predictor, causal_pairs
from shared.policy import BatchStats, ClockRule, PoolShape, microbatch_depth, split_microbatches
from shared.policy import choose_operating_point as choose
from shared.policy.operating_point import point_tables
from shared.policy.pipeline import iteration_cost, seam_transfer_s

PROMPT = 2000  # one prompt chunk: far more than an even microbatch's share beside a few decode steps
CTX = 1500  # each decode sequence's context


@pytest.fixture(scope="module")
def pred() -> Predictor:
    return cached_predictor(load_profile("a800"), get_model("qwen3-32b"))


def _iteration(n_decode: int) -> tuple[BatchStats, list[tuple[float, float, float]]]:
    """One prompt chunk then `n_decode` decode steps: the pooled stats and each sequence's (new, ctx, pairs)."""
    seqs = [(float(PROMPT), float(PROMPT), causal_pairs(PROMPT, PROMPT))]
    seqs += [(1.0, float(CTX + 1), float(CTX + 1))] * n_decode
    stats = BatchStats("prefill", sum(s[0] for s in seqs), sum(s[1] for s in seqs), sum(s[2] for s in seqs),
                       1 + n_decode, *seqs[0], n_seqs=len(seqs))
    return stats, seqs


def _top_costs(pred: Predictor) -> tuple[Any, Any, Any]:
    """The attention, FFN and LM-head cost callables at the top clock."""
    top = len(pred.clocks) - 1

    def att(n: float, ctx: float, pairs: float, shard: int) -> tuple[float, float]:
        t, e = pred.predict("attention", "prefill", n, ctx, pairs, shard=shard)
        return float(t[top]), float(e[top])

    def ffn(n: float, shard: int) -> tuple[float, float]:
        t, e = pred.predict("ffn", "prefill", n, shard=shard)
        return float(t[top]), float(e[top])

    def head(n: float, shard: int) -> tuple[float, float]:
        t, e = pred.predict("lm_head", "decode", max(1.0, n), shard=shard)
        return float(t[top]), float(e[top])

    return att, ffn, head


@pytest.mark.parametrize(("n_decode", "attention", "expected_max_depth"), [(0, 1, 1), (2, 1, 3), (5, 2, 3)])
def test_the_planner_cuts_no_deeper_than_a_group_has_sequences(pred: Predictor, n_decode: int, attention: int,
                                                               expected_max_depth: int) -> None:
    stats, _ = _iteration(n_decode)
    shape = PoolShape(split=True, attention=attention, ffn=1)
    assert stats.group_seqs(shape.units) == expected_max_depth
    depths = {t.depth for t in point_tables(pred, shape, stats, ClockRule(depths=(1, 2, 3, 4))).depths}
    assert max(depths) == expected_max_depth == microbatch_depth(4, expected_max_depth)
    op = choose(pred, shape, stats, 10.0, ClockRule(depths=(1, 2, 3, 4)))
    assert op.depth <= expected_max_depth


def test_a_prompt_is_not_pipelined_with_itself(pred: Predictor) -> None:
    """One 2,000-token chunk beside 3 decode steps at depth 2 on 1 + 1 GPUs: the live cut puts the chunk in
    one microbatch and the decodes in the other, so each layer lasts at least the chunk's own attention,
    hop, FFN and hop. The model's iteration is no shorter than that reckoning, and close to it."""
    stats, seqs = _iteration(3)
    shape = PoolShape(split=True, attention=1, ffn=1)
    att, ffn, head = _top_costs(pred)
    args = pred.args
    idle = float(pred.idle_table[-1])
    t_model, _ = iteration_cost(att, ffn, head, shape, stats, 2, args.dim, args.n_layers, idle, idle)

    groups = split_microbatches([int(s[0]) for s in seqs], 2)  # what the scheduler sends
    assert [len(g) for g in groups] == [1, 3]
    ta, tf, trip = [], [], []
    for g in groups:
        n, ctx, pairs = (sum(seqs[i][k] for i in g) for k in range(3))
        a, f = att(n, ctx, pairs, 1)[0], ffn(n, 1)[0]
        ta.append(a)
        tf.append(f)
        trip.append(a + f + 2 * seam_transfer_s(n, args.dim, shape.link_bytes_s))
    cycle = max(sum(ta), sum(tf), max(trip))  # per layer: each side in turn, or the slowest round trip
    t_live = args.n_layers * cycle + head(stats.n_sample, 1)[0]
    assert t_model >= 0.999 * t_live
    assert t_model <= 1.1 * t_live
    # before the correction the chunk's tokens were spread over both microbatches, hiding half its hops
    even = BatchStats("prefill", stats.n_tokens, stats.ctx_tokens, stats.pairs, stats.n_sample, n_seqs=4)
    t_even, _ = iteration_cost(att, ffn, head, shape, even, 2, args.dim, args.n_layers, idle, idle)
    assert t_even < 0.9 * t_live


def test_groups_without_a_sequence_idle_instead_of_reading_their_weights() -> None:
    """One prompt on four colocated replicas (or four attention groups): the scheduler places it whole on
    one, the other three idle through the iteration (issue 38, correction 7, in part); before, each of the
    four read its weights for a quarter of the prompt."""
    from shared.policy.pipeline import colocated_iteration

    w_s, per_token_s, power_w, idle_w, layers = 1e-3, 1e-5, 300.0, 60.0, 4

    def att(n: float, ctx: float, pairs: float, shard: int) -> tuple[float, float]:
        t = w_s + n * per_token_s  # a weight read, then the tokens
        return t, t * power_w

    def ffn(n: float, shard: int) -> tuple[float, float]:
        return att(n, 0.0, 0.0, shard)

    def head(n: float, shard: int) -> tuple[float, float]:
        return 0.0, 0.0

    one = BatchStats("prefill", 800.0, 800.0, 320_400.0, 1.0, 800.0, 800.0, 320_400.0, n_seqs=1)
    assert one.busy_units(4) == 1 and BatchStats("decode", 9, 9, 9, 9).busy_units(4) == 4
    replicas = PoolShape(split=False, replicas=4, tp=1)
    t, e = iteration_cost(att, ffn, head, replicas, one, 1, 4096, layers, idle_w, idle_w)
    ta, ea = att(800.0, 0.0, 0.0, 1)
    t1, e1 = colocated_iteration(ta, ea, ta, ea, 0.0, 0.0, 0.0, layers, 1, idle_w)
    assert t == pytest.approx(t1) and e == pytest.approx(e1 + 3 * idle_w * t1)
    groups = PoolShape(split=True, attention=4, ffn=1, attention_tp=1)
    t_split, e_split = iteration_cost(att, ffn, head, groups, one, 1, 4096, layers, idle_w, idle_w)
    tc = seam_transfer_s(800.0, 4096, groups.link_bytes_s)
    assert t_split == pytest.approx(layers * (2 * ta + 2 * tc))  # one group's attention, the FFN, two hops
    busy_j = layers * ea + idle_w * (t_split - layers * ta)  # the busy group: its attention, then waiting
    ffn_j = layers * ea + idle_w * (t_split - layers * ta)
    assert e_split == pytest.approx(busy_j + ffn_j + 3 * idle_w * t_split)

"""The live scheduler's `aflex` batching: the simulator's rules (shortest prompt first with aging, the
prefill cap from the SLOs) and clock objective, on the scheduler's monotonic clock.

Pure tests of passes.py / aflex.py first (time is injected, nothing sleeps), then the scheduler on
a real nats-server with tests/test_scheduler.py's fake workers.
"""

from __future__ import annotations

import asyncio

import pytest

from loadgen.sim.policies import policy_spec
from services.scheduler.aflex import BATCHING, CLOCK_OBJECTIVE, AflexPlanner, serving_order
from services.scheduler.prefill_cap import PrefillCap
from services.scheduler.state import RequestState
from shared.messages import SamplingSpec
from shared.perf import cached_predictor, causal_pairs
from shared.policy import BatchStats, ClockRule, PoolShape, PrefillQuery, choose_operating_point, prefill_budget
from shared.policy.iteration import KvRoom
from shared.policy.prefill_cap import AT_MAX, prefill_stats_at
from tests.services.scheduler.test_scheduler import FakeAttention, mesh, plan_iteration, wait_for
from tests.services.scheduler.test_scheduler_policy import A800, QWEN, ProfiledAttention, live


def _state(rid: str, prompt_len: int, received: float, *, computed: int = 0, output: int = 0) -> RequestState:
    s = RequestState(rid, [5] * prompt_len, SamplingSpec(max_tokens=50), 0.0, received_mono=received)
    s.output_ids = [100 + i for i in range(output)]
    s.num_computed = computed
    return s


def _order(passes: list) -> list[tuple[str, int]]:
    return [(p.state.request_id, p.n_new) for p in passes]


# -- the same rules as the simulator's aflex ------------------------------------------------------


def test_live_rules_are_the_simulators_aflex() -> None:
    sim = policy_spec("aflex")
    assert sim.batching == BATCHING and BATCHING.order == "srpt" and BATCHING.prefill_iter_frac > 0
    assert CLOCK_OBJECTIVE == sim.clock.objective == "idle-aware"
    pl = AflexPlanner(QWEN, ttft_slo_ms=400, tpot_slo_ms=120, depths=(1, 2, 3, 4))
    assert pl.rule == ClockRule(depths=(1, 2, 3, 4), objective="idle-aware") and pl.batching == sim.batching


# -- ordering (pure) -------------------------------------------------------------------------------


def test_short_prompt_is_admitted_before_an_earlier_long_one() -> None:
    long, short = _state("long", 500, received=10.0), _state("short", 20, received=11.0)
    passes, admitted = plan_iteration([], [long, short], max_batch_tokens=64, max_num_seqs=8, rule=BATCHING,
                                      now=12.0)
    assert admitted == [short, long] and _order(passes) == [("short", 20), ("long", 44)]
    # first-come first-served without the rule (the other clock policies)
    passes, admitted = plan_iteration([], [long, short], max_batch_tokens=64, max_num_seqs=8)
    assert admitted == [long] and _order(passes) == [("long", 64)]


def test_aging_admits_an_old_long_prompt_first() -> None:
    long = _state("long", 500, received=0.0)
    # fresh short prompts keep arriving: the long one waits while young, goes first once aged past aging_s
    for now, first in ((1.0, "s0"), (BATCHING.aging_s * 0.9, "s0"), (BATCHING.aging_s + 0.5, "long")):
        shorts = [_state(f"s{i}", 20, received=now - 0.5 + i * 0.1) for i in range(3)]
        _, admitted = plan_iteration([], [long, *shorts], max_batch_tokens=64, max_num_seqs=1, rule=BATCHING, now=now)
        assert [s.request_id for s in admitted] == [first], now
    # aged prompts rank with the shortest, and among themselves in arrival order
    now = BATCHING.aging_s + 1.0
    older, short = _state("older", 900, received=-5.0), _state("s0", 20, received=now - 1.0)
    _, admitted = plan_iteration([], [long, older, short], max_batch_tokens=4096, max_num_seqs=8, rule=BATCHING,
                                 now=now)
    assert [s.request_id for s in admitted] == ["older", "long", "s0"]


def test_a_higher_priority_request_is_admitted_first_under_either_order() -> None:
    early, urgent = _state("early", 20, received=10.0), _state("urgent", 500, received=11.0)
    urgent.priority = -1
    for rule in (BATCHING, None):  # shortest first, or first come (the other clock policies)
        _, admitted = plan_iteration([], [early, urgent], max_batch_tokens=64, max_num_seqs=1, rule=rule, now=12.0)
        assert admitted == [urgent], rule


def test_a_refused_aged_prompt_is_not_overtaken_and_running_work_goes_on() -> None:
    aged = _state("aged", 300, received=0.0)
    short = _state("short", 10, received=40.0)
    dec = _state("dec", 5, received=1.0, computed=6, output=2)  # decoding: one token to feed
    part = _state("part", 200, received=39.0, computed=150)  # an unfinished prefill, 50 tokens left
    passes, admitted = plan_iteration([dec, part], [aged, short], max_batch_tokens=1000, max_num_seqs=8,
                                      kv=KvRoom(free_blocks=100, block_size=1), rule=BATCHING, now=41.0)
    assert admitted == [] and _order(passes) == [("dec", 1), ("part", 50)]
    passes, admitted = plan_iteration([dec, part], [aged, short], max_batch_tokens=1000, max_num_seqs=8,
                                      rule=BATCHING, now=41.0)
    assert admitted == [aged, short] and _order(passes) == [("dec", 1), ("aged", 300), ("short", 10), ("part", 50)]


def test_prefill_cap_bounds_prefill_tokens_not_decodes() -> None:
    decs = [_state(f"d{i}", 4, received=0.0, computed=5, output=2) for i in range(3)]  # one token each to feed
    waiting = [_state("w1", 100, received=1.0), _state("w2", 100, received=2.0)]
    seen: list[PrefillQuery] = []

    def cap(query: PrefillQuery) -> int:
        seen.append(query)
        return 120

    passes, admitted = plan_iteration(decs, waiting, max_batch_tokens=1000, max_num_seqs=8, rule=BATCHING, now=3.0,
                                      prefill_cap=cap)
    # w1 came at 1.0: the oldest prompt queued has waited 2 s
    assert seen == [PrefillQuery(queued_tokens=200, n_decode=3, decode_ctx_tokens=15.0, head_tokens=100,
                                 oldest_wait_s=2.0)]
    assert _order(passes) == [("d0", 1), ("d1", 1), ("d2", 1), ("w1", 100), ("w2", 20)] and admitted == waiting
    # every prompt token is fed over the iterations: nothing is lost to the cap
    fed = {"w1": 0, "w2": 0}
    running: list[RequestState] = []
    for _ in range(5):
        passes, admitted = plan_iteration(running, [s for s in waiting if s not in running], max_batch_tokens=1000,
                                          max_num_seqs=8, rule=BATCHING, now=3.0, prefill_cap=lambda _: 64)
        running += admitted
        for p in passes:
            fed[p.state.request_id] += p.n_new
            p.state.num_computed += p.n_new
    assert fed == {"w1": 100, "w2": 100}


def test_the_prefill_cap_hands_the_formers_question_to_the_planner_field_by_field() -> None:
    """`PrefillCap`: the former's question (a `PrefillQuery`) reaches `AflexPlanner.prefill_tokens` whole, with the
    worker's profile and the fleet's share beside it."""
    asked: list[tuple[object, ...]] = []

    class Planner:
        def prefill_tokens(self, profile: object, query: PrefillQuery, share: int) -> int:
            asked.append((profile, query, share))
            return 120

    decs = [_state(f"d{i}", 4, received=0.0, computed=5, output=2) for i in range(3)]
    waiting = [_state("w1", 100, received=1.0), _state("w2", 100, received=2.0)]
    passes, admitted = plan_iteration(decs, waiting, max_batch_tokens=1000, max_num_seqs=8, rule=BATCHING, now=3.0,
                                      prefill_cap=PrefillCap(Planner(), A800, share=2))  # type: ignore[arg-type]
    query = PrefillQuery(queued_tokens=200, n_decode=3, decode_ctx_tokens=15.0, head_tokens=100, oldest_wait_s=2.0)
    assert asked == [(A800, query, 2)]
    assert _order(passes) == [("d0", 1), ("d1", 1), ("d2", 1), ("w1", 100), ("w2", 20)] and admitted == waiting
    pl = AflexPlanner(QWEN, ttft_slo_ms=400, tpot_slo_ms=120, depths=(1, 2, 3, 4))
    query = PrefillQuery(queued_tokens=8000, n_decode=64, decode_ctx_tokens=64 * 500.0, head_tokens=8000)
    assert PrefillCap(pl, A800, share=2)(query) == pl.prefill_tokens(A800, query, share=2)


def test_serving_order_is_prefill_order_on_the_injected_clock() -> None:
    queue = [(0.0, 900.0), (50.0, 10.0), (51.0, 500.0)]
    assert serving_order(52.0, queue) == [0, 1, 2]  # the first has aged past aging_s
    assert serving_order(20.0, [(0.0, 900.0), (19.0, 10.0)]) == [1, 0]


# -- the prefill cap (pure) -----------------------------------------------------------------------


def test_prefill_tokens_is_the_policys_budget() -> None:
    pl = AflexPlanner(QWEN, ttft_slo_ms=400, tpot_slo_ms=120, depths=(1, 2, 3, 4))
    pred = cached_predictor(A800, QWEN)

    def time_at_max(tokens: int, n_dec: int = 0, ctx_sum: float = 0.0) -> float:  # the simulator's
        q1 = float(tokens)
        st = BatchStats("prefill", n_dec + tokens, ctx_sum + n_dec + tokens, ctx_sum + n_dec + tokens * tokens / 2,
                        n_dec + 1, q1, q1, causal_pairs(q1, q1))
        rule = ClockRule(max_clock=True, depths=(1,))
        return choose_operating_point(pred, PoolShape(split=True), st, 0.0, rule).time_s

    iter_s = BATCHING.prefill_iter_frac * 0.400
    n = pl.prefill_tokens(A800, PrefillQuery(queued_tokens=8000, head_tokens=8000))
    assert n == prefill_budget(BATCHING, 8000, 0, time_at_max, 0.0, prefill_iter_s=iter_s)
    # the largest that fits, to the 64 tokens the search resolves
    assert BATCHING.min_chunk_tokens <= n < 2048 and time_at_max(n) <= iter_s < time_at_max(n + 64)
    # with decode sequences in the iteration the TPOT budget bounds it, never below min_chunk_tokens
    tpot_b = pl.margins["decode"].budget(0.120)
    m = pl.prefill_tokens(A800, PrefillQuery(queued_tokens=8000, n_decode=64, decode_ctx_tokens=64 * 500.0,
                                             head_tokens=8000))
    assert m == prefill_budget(BATCHING, 8000, 64, lambda t: time_at_max(t, 64, 64 * 500.0), tpot_b,
                               prefill_iter_s=iter_s)
    assert m >= BATCHING.min_chunk_tokens
    assert pl.prefill_tokens(A800, PrefillQuery(queued_tokens=100)) == 100  # a small queue is taken whole


# -- live -----------------------------------------------------------------------------------------


async def _first_order(batching: str, freq_policy: str, url: str) -> list[str]:
    """Long then short submitted while the worker is busy: the request ids of their first passes, in order."""
    a0 = FakeAttention(None, "a0", delay_s=0.3)  # type: ignore[arg-type]
    async with mesh(url, attn=(a0,), max_batch_tokens=64, microbatch_depth="1", batching=batching,
                    freq_policy=freq_policy) as m:
        first = asyncio.create_task(m.run_request("busy", [5, 6, 7], max_tokens=3))
        await wait_for(lambda: bool(a0.seqs_of("busy")))
        streams = {rid: await m.stream(rid) for rid in ("long", "short")}
        for rid, n in (("long", 200), ("short", 10)):
            assert (await m.submit(rid, [7] * n, max_tokens=2)).accepted
        await first
        for q in streams.values():
            deltas = []
            while not deltas or deltas[-1].finish_reason is None:
                deltas.append(await asyncio.wait_for(q.get(), 10))
            assert deltas[-1].finish_reason == "length" and sum(len(d.token_ids) for d in deltas) == 2
        fed = {rid: sum(len(d.seqs[i].token_ids) for d, i in a0.seqs_of(rid) if d.seqs[i].start_pos < n)
               for rid, n in (("long", 200), ("short", 10))}
        assert fed == {"long": 200, "short": 10}  # every prompt token fed once: nothing lost
        return [s.seq_id for d in a0.descriptors for s in d.seqs if s.seq_id in ("long", "short")]


def test_live_aflex_batching_serves_the_short_prompt_first_whatever_the_clocks(nats_url: str) -> None:
    order = asyncio.run(_first_order("aflex", "max", nats_url))  # the batching setting decides, not the clocks
    assert order[0] == "short"
    order = asyncio.run(_first_order("fcfs", "aflex", nats_url))  # first-come first-served
    assert order[0] == "long"


def test_live_prefill_iterations_are_capped_by_the_ttft_budget(nats_url: str) -> None:
    async def main() -> None:
        a0 = ProfiledAttention(None, "a0", kv_total_blocks=20000)  # type: ignore[arg-type]
        async with live(nats_url, a0, max_batch_tokens=4096, microbatch_depth="1") as lv:
            await lv.ffn("f0")
            done = await lv.submit("big", 3000, 2)
            await asyncio.wait_for(done.wait(), 15)
            chunks = [len(s.token_ids) for d, i in a0.seqs_of("big") if (s := d.seqs[i]).start_pos < 3000]
            planner = lv.sched.governor.planner
            assert planner is not None and sum(chunks) == 3000 and len(chunks) > 1  # all fed, none twice
            left = 3000
            for c in chunks:  # each iteration takes the policy's cap for what is left
                assert c == planner.prefill_tokens(A800, PrefillQuery(queued_tokens=left, head_tokens=left))
                at_max_s = choose_operating_point(planner.predictor(A800), PoolShape(split=True, link_bytes_s=
                                                  planner.link_bytes_s), prefill_stats_at(c), 0.0, AT_MAX).time_s
                assert c == left or (BATCHING.min_chunk_tokens <= c and at_max_s <= BATCHING.prefill_iter_frac * 0.400)
                left -= c
    asyncio.run(main())


@pytest.mark.parametrize("policy", ["slo", "max", "aflex"])
def test_live_fcfs_batching_keeps_the_token_budget_under_any_clock_policy(nats_url: str, policy: str) -> None:
    async def main() -> None:
        a0 = ProfiledAttention(None, "a0", kv_total_blocks=20000)  # type: ignore[arg-type]
        async with live(nats_url, a0, max_batch_tokens=4096, microbatch_depth="1", freq_policy=policy,
                        batching="fcfs") as lv:
            await lv.ffn("f0")
            await asyncio.wait_for((await lv.submit("big", 3000, 2)).wait(), 15)
            chunks = [len(s.token_ids) for d, i in a0.seqs_of("big") if (s := d.seqs[i]).start_pos < 3000]
            assert chunks == [3000] and lv.sched.batching.rule is None
    asyncio.run(main())

"""The one iteration former (`shared.policy.iteration`) that the scheduler, the engine and the simulator share.

The microbatch split, the former on its own and through the scheduler's `plan_iteration` (the
engine's first-come first-served rule and the `aflex` rule), the simulator's prefill-chunk walk
with a per-sequence cap, and the engine's tokens when its steps are formed by it.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from services.scheduler import aflex
from services.scheduler.state import RequestState
from shared.engine import Engine
from shared.messages import SamplingSpec
from shared.model.checkpoint import open_checkpoint
from shared.model.sampling import SamplingParams
from shared.policy import (
    AFLEX_BATCHING,
    SHARED_BATCHING,
    SHARED_CLOCK_OBJECTIVE,
    KvRoom,
    PrefillQuery,
    WorkItem,
    form_iteration,
    microbatch_depth,
    parse_depth,
    planner_depths,
    split_microbatches,
)
from tests.services.scheduler.test_scheduler import plan_iteration

SRPT = SHARED_BATCHING


# -- the microbatch split -------------------------------------------------------------------------


def _groups(token_counts: list[int], depth: int) -> list[list[int]]:
    return [list(r) for r in split_microbatches(token_counts, depth)]


def test_split_is_contiguous_by_tokens() -> None:
    assert _groups([1] * 6, 3) == [[0, 1], [2, 3], [4, 5]]
    # a group opens once the tokens before it reach its share: the item that crosses the line stays behind
    assert _groups([4, 4, 1, 1, 1, 1], 2) == [[0, 1], [2, 3, 4, 5]]
    assert _groups([3, 1, 1, 3], 2) == [[0, 1], [2, 3]]


def test_split_gives_every_group_an_item_when_there_are_enough() -> None:
    # by tokens alone the long prefill would take every group; each still gets a sequence to overlap
    assert _groups([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert _groups([100, 1, 1, 1], 4) == [[0], [1], [2], [3]]
    assert _groups([1, 1, 1000], 3) == [[0], [1], [2]]
    assert _groups([1, 1, 1000], 2) == [[0, 1], [2]]


def test_split_depth_beyond_items_and_empty() -> None:
    assert _groups([5, 7], 4) == [[0], [1]]
    assert _groups([9], 3) == [[0]]
    assert split_microbatches([], 2) == []
    with pytest.raises(ValueError, match="at least 1"):
        split_microbatches([1, 2], 0)


def test_split_covers_every_item_once_in_order() -> None:
    rng = random.Random(12)
    for _ in range(300):
        counts = [rng.choice([1, 1, 1, rng.randint(1, 4096)]) for _ in range(rng.randint(1, 12))]
        depth = rng.randint(1, 5)
        groups = split_microbatches(counts, depth)
        assert len(groups) == min(depth, len(counts)) and all(len(g) > 0 for g in groups)
        assert [i for g in groups for i in g] == list(range(len(counts)))


def test_microbatch_depth_setting() -> None:
    assert microbatch_depth("auto", 3) == 1 and microbatch_depth("auto", 4) == 2
    assert microbatch_depth(3, 2) == 2 and microbatch_depth(4, 10) == 4 and microbatch_depth(2, 0) == 1
    assert microbatch_depth("auto", 6, planned=3) == 3 and microbatch_depth(2, 6, planned=3) == 2
    assert parse_depth("auto") == "auto" and parse_depth("3") == 3 and parse_depth(2) == 2
    assert planner_depths("auto") == (1, 2, 3, 4) and planner_depths(2) == (2,)
    for bad in ("0", "-1", "two", "", 0, True):
        with pytest.raises(ValueError, match="microbatch depth"):
            parse_depth(bad)


# -- the former, alone and through the scheduler --------------------------------------------------


def _req(rid: str, prompt: int, received: float = 0.0, *, computed: int = 0, output: int = 0) -> RequestState:
    state = RequestState(rid, [7] * prompt, SamplingSpec(max_tokens=50), 0.0, received_mono=received)
    state.output_ids, state.num_computed = [100] * output, computed
    return state


def _fed(form_or_passes: object) -> list[tuple[str, int]]:
    if isinstance(form_or_passes, list):
        return [(p.state.request_id, p.n_new) for p in form_or_passes]
    return [(str(f.key), f.n_tokens) for f in form_or_passes.feeds]  # type: ignore[attr-defined]


def test_fcfs_keeps_running_order_and_a_rule_puts_decode_steps_first() -> None:
    part = _req("part", 10, computed=4)  # an unfinished prefill: 6 tokens left
    dec = _req("dec", 3, computed=4, output=2)  # decoding: 1 token
    passes, _ = plan_iteration([part, dec], [], max_batch_tokens=6, max_num_seqs=8)
    assert _fed(passes) == [("part", 6)]  # the engine's rule: running order, the decode step waits
    passes, _ = plan_iteration([part, dec], [], max_batch_tokens=6, max_num_seqs=8, rule=SRPT)
    assert _fed(passes) == [("dec", 1), ("part", 5)]
    assert _fed(form_iteration((), [WorkItem("part", 6), WorkItem("dec", 1)], token_budget=6)) == [("part", 6)]
    form = form_iteration([WorkItem("dec", 1)], [WorkItem("part", 6)], token_budget=6, rule=SRPT)
    assert _fed(form) == [("dec", 1), ("part", 5)] and form.admitted == () and form.n_tokens == 6


def test_srpt_serves_the_short_prompt_first_until_the_long_one_has_aged() -> None:
    long, short = _req("long", 50, received=0.0), _req("short", 5, received=1.0)
    cases = [(None, 2.0, [("long", 40)], [long]),  # fcfs
             (SRPT, 2.0, [("short", 5), ("long", 35)], [short, long]),
             (SRPT, SRPT.aging_s + 1.0, [("long", 40)], [long])]  # aged: ranks with the shortest, arrived first
    for rule, now, fed, admitted in cases:
        passes, got = plan_iteration([], [long, short], max_batch_tokens=40, max_num_seqs=8, rule=rule, now=now)
        assert _fed(passes) == fed and got == admitted, (rule, now)
        items = [WorkItem(s.request_id, s.pending_tokens, s.received_mono, True) for s in (long, short)]
        form = form_iteration((), items, token_budget=40, max_num_seqs=8, rule=rule, now_s=now)
        assert _fed(form) == fed and list(form.admitted) == [s.request_id for s in admitted]


def test_a_refusal_stops_admission_but_admitted_work_goes_on() -> None:
    a, b, c = _req("a", 5, 1.0), _req("b", 5, 1.0), _req("c", 5, 2.0)
    part = _req("part", 8, 0.5, computed=2)  # 6 tokens left, served after the three under srpt at now=3
    no_b = KvRoom(free_blocks=4, block_size=1, reserved_blocks={a: 1, c: 1})  # b's 5 tokens do not fit
    passes, admitted = plan_iteration([], [a, b, c], max_batch_tokens=100, max_num_seqs=8, kv=no_b)
    assert _fed(passes) == [("a", 5)] and admitted == [a]  # c does not overtake b
    passes, admitted = plan_iteration([part], [a, b, c], max_batch_tokens=100, max_num_seqs=8, kv=no_b,
                                      rule=SRPT, now=3.0)
    assert _fed(passes) == [("a", 5), ("part", 6)] and admitted == [a]
    asked: list[str] = []

    def can_admit(key: str) -> bool:
        asked.append(key)
        return key != "b"
    items = [WorkItem("part", 6, 0.5), *(WorkItem(k, 5, t, True) for k, t in (("a", 1.0), ("b", 1.0), ("c", 2.0)))]
    form = form_iteration((), items, token_budget=100, rule=SRPT, now_s=3.0, can_admit=can_admit)
    assert _fed(form) == [("a", 5), ("part", 6)] and form.admitted == ("a",) and asked == ["a", "b"]


def test_max_num_seqs_counts_every_running_sequence() -> None:
    dec = _req("dec", 3, computed=4, output=2)
    flying = _req("flying", 3, computed=4, output=2)
    flying.in_flight = True  # holds a place, has nothing to feed this iteration
    waiting = [_req(f"w{i}", 2, float(i)) for i in range(3)]
    for rule in (None, SRPT):
        passes, admitted = plan_iteration([dec], waiting, max_batch_tokens=100, max_num_seqs=3, rule=rule, now=9.0)
        assert _fed(passes) == [("dec", 1), ("w0", 2), ("w1", 2)] and admitted == waiting[:2]
        passes, admitted = plan_iteration([dec, flying], waiting, max_batch_tokens=100, max_num_seqs=3, rule=rule)
        assert _fed(passes) == [("dec", 1), ("w0", 2)] and admitted == waiting[:1]
    items = [WorkItem(f"w{i}", 2, float(i), True) for i in range(3)]
    form = form_iteration([WorkItem("dec", 1)], items, token_budget=100, max_num_seqs=3, running_count=2)
    assert form.admitted == ("w0",)


def test_prefill_cap_sees_the_queue_in_serving_order_and_spares_decode_steps() -> None:
    seen: list[PrefillQuery] = []

    def cap(query: PrefillQuery) -> int:
        seen.append(query)
        return 100
    decodes = [WorkItem("d0", 1, context_tokens=7), WorkItem("d1", 1, context_tokens=5)]
    queue = [WorkItem("w1", 100, 1.0, True), WorkItem("w2", 30, 2.0, True)]
    form = form_iteration(decodes, queue, token_budget=1000, rule=SRPT, now_s=3.0, prefill_cap=cap)
    # w2 is first under srpt; w1, queued at 1.0, has waited 2 s
    assert seen == [PrefillQuery(queued_tokens=130, n_decode=2, decode_ctx_tokens=12.0, head_tokens=30,
                                 oldest_wait_s=2.0)]
    assert _fed(form) == [("d0", 1), ("d1", 1), ("w2", 30), ("w1", 70)] and form.admitted == ("w2", "w1")
    form = form_iteration(decodes, queue, token_budget=1000, prefill_cap=lambda *_: -5)
    assert _fed(form) == [("d0", 1), ("d1", 1)] and form.admitted == ()
    form = form_iteration(decodes, queue, token_budget=1, prefill_cap=cap)  # the budget binds before the cap
    assert _fed(form) == [("d0", 1)]


# -- the simulator's prefill chunk ----------------------------------------------------------------


def _sim_walk(queue: list[list[int]], take: int, cap: int) -> list[tuple[int, int]]:
    """`Simulation._start`'s chunk loop as it was written before the former."""
    chunk: list[tuple[int, int]] = []
    left = take
    for rid, rem in queue:
        if left <= 0:
            break
        q = min(rem, left, cap)
        chunk.append((rid, q))
        left -= q
    return chunk


def test_per_item_cap_takes_min_of_remaining_left_and_cap_in_order() -> None:
    queue = [[0, 300], [1, 50], [2, 400], [3, 10]]
    form = form_iteration((), [WorkItem(rid, rem) for rid, rem in queue], token_budget=500, seq_cap=256)
    assert [(f.key, f.n_tokens) for f in form.feeds] == [(0, 256), (1, 50), (2, 194)]
    assert [f.completes for f in form.feeds] == [False, True, False] and form.admitted == ()
    rng = random.Random(5)
    for _ in range(300):
        queue = [[rid, rng.randint(1, 3000)] for rid in range(rng.randint(1, 8))]
        take, cap = rng.randint(1, 5000), rng.randint(1, 4096)
        form = form_iteration((), [WorkItem(rid, rem) for rid, rem in queue], token_budget=take, seq_cap=cap)
        assert [(f.key, f.n_tokens) for f in form.feeds] == _sim_walk(queue, take, cap)
    with pytest.raises(ValueError, match="seq_cap"):
        form_iteration((), [WorkItem(0, 5)], token_budget=5, seq_cap=0)


# -- the engine ------------------------------------------------------------------------------------


def _engine(path: Path, *, num_kv_blocks: int = 128, max_batch_tokens: int = 2048, max_num_seqs: int = 256,
            microbatches: int = 1) -> Engine:
    return Engine.from_checkpoint(open_checkpoint(str(path)), num_kv_blocks=num_kv_blocks, block_size=4,
                                  max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs,
                                  microbatches=microbatches)


def test_engine_steps_are_fcfs_within_the_token_budget_and_max_num_seqs(tiny_checkpoints: dict[str, Path]) -> None:
    engine = _engine(tiny_checkpoints["llama"], max_batch_tokens=6, max_num_seqs=2)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for rid, prompt in (("a", [1, 2, 3, 4]), ("b", [5, 6, 7, 8]), ("c", [9])):
        engine.add_request(rid, prompt, params)
    engine.step()
    assert [(s.seq_id, s.num_computed) for s in engine.running] == [("a", 4), ("b", 2)]
    assert [s.seq_id for s in engine.waiting] == ["c"]
    engine.step()  # a decodes, b finishes its prompt; c still waits for a place
    assert [(s.seq_id, s.num_computed, len(s.output_ids)) for s in engine.running] == [("a", 5, 2), ("b", 4, 1)]
    assert [s.seq_id for s in engine.waiting] == ["c"]


def test_engine_tokens_hold_for_microbatches_and_preemption(tiny_checkpoints: dict[str, Path]) -> None:
    prompts = [[5, 17, 33, 101, 7, 250, 11, 64, 3], [1, 2, 3], [40 + i for i in range(14)], [200], [9] * 5]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    roomy = [c.token_ids for c in _engine(tiny_checkpoints["llama"]).generate(prompts, params)]
    for microbatches in (1, 2, 3):
        tight = _engine(tiny_checkpoints["llama"], num_kv_blocks=12, max_batch_tokens=8, microbatches=microbatches)
        assert [c.token_ids for c in tight.generate(prompts, params)] == roomy, f"microbatches={microbatches}"
        assert tight.num_preemptions > 0
        assert tight.block_tables.allocator.num_free_blocks == 12


def test_aflex_constants_are_the_shared_specs() -> None:
    """The live planner batches as the shared machinery, plus AFlex's own per-request decode budget."""
    assert aflex.BATCHING is AFLEX_BATCHING and aflex.CLOCK_OBJECTIVE == SHARED_CLOCK_OBJECTIVE == "idle-aware"
    assert replace(SHARED_BATCHING, decode_slack=True) == AFLEX_BATCHING and not SHARED_BATCHING.decode_slack
    assert SHARED_BATCHING.order == "srpt" and SHARED_BATCHING.adaptive and SHARED_BATCHING.prefill_iter_frac == 0.3

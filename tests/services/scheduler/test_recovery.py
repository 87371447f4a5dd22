"""`InFlight` after the scheduler's NATS connection dropped: nothing is given up at once; the worker's
next heartbeat settles each microbatch (still running: waited for; not there: lost, no one's fault)."""

from __future__ import annotations

import asyncio

import pytest

from services.scheduler import recovery
from services.scheduler.recovery import InFlight, MicrobatchLostError
from services.scheduler.registry import Worker
from services.scheduler.state import RequestState, Status
from shared.messages import MicrobatchDone, SamplingSpec


def test_after_a_dropped_connection_the_next_heartbeat_settles_each_microbatch(monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    monkeypatch.setattr(recovery, "LOST_CONFIRM_S", 0.01)

    async def main() -> None:
        in_flight = InFlight()
        running = in_flight.track("mb-running", "a0", now=100.0)
        done_lost = in_flight.track("mb-done-lost", "a0", now=100.0)
        other = in_flight.track("mb-other", "a1", now=100.0)
        in_flight.bus_lost()
        await asyncio.sleep(0.02)
        assert not any(f.done() for f in (running, done_lost, other))  # none given up at once
        in_flight.check_heartbeat("a0", {"mb-running"}, now=100.5, grace_s=3.0)  # well within the grace
        await asyncio.sleep(0.05)
        with pytest.raises(MicrobatchLostError, match="in flight when the NATS connection dropped"):
            done_lost.result()
        assert not running.done() and not other.done()  # still running, and a1 has not beaten yet
        in_flight.settle(MicrobatchDone(mb_id="mb-running", worker_id="a0", results=[], kv_free_blocks=1,
                                        kv_total_blocks=1))
        assert running.result().mb_id == "mb-running"
        in_flight.check_heartbeat("a1", {"mb-other"}, now=100.6, grace_s=3.0)
        await asyncio.sleep(0.05)
        assert not other.done()
        late = in_flight.track("mb-late", "a1", now=101.0)  # sent after the drop: the usual grace holds
        in_flight.check_heartbeat("a1", {"mb-other"}, now=101.5, grace_s=3.0)
        await asyncio.sleep(0.05)
        assert not late.done()
    asyncio.run(main())


def test_a_descriptor_sent_after_the_workers_newest_is_on_its_way_not_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """A saturated worker takes its messages late: its heartbeat, missing a descriptor it has not taken yet,
    must not make the scheduler send its sequences again (the worker would refuse them, `sequence_busy`)."""
    monkeypatch.setattr(recovery, "LOST_CONFIRM_S", 0.01)

    async def main() -> None:
        in_flight = InFlight()
        taken = in_flight.track("mb-1", "a0", now=100.0)
        in_flight.note_sent("mb-2-r", "a0")  # a release-only descriptor: untracked, but in the order
        queued = in_flight.track("mb-3", "a0", now=100.0)
        in_flight.check_heartbeat("a0", set(), now=110.0, grace_s=3.0, newest_mb_id="mb-2-r")
        await asyncio.sleep(0.05)
        with pytest.raises(MicrobatchLostError):  # taken and not running: its Done was lost
            taken.result()
        assert not queued.done()  # sent after the newest it took: still on its way
        in_flight.check_heartbeat("a0", set(), now=111.0, grace_s=3.0, newest_mb_id="mb-3")
        await asyncio.sleep(0.05)
        with pytest.raises(MicrobatchLostError):  # taken now, and neither running nor done: lost
            queued.result()
        unknown = in_flight.track("mb-4", "a0", now=100.0)
        in_flight.check_heartbeat("a0", set(), now=112.0, grace_s=3.0, newest_mb_id="mb-of-another-run")
        await asyncio.sleep(0.05)
        with pytest.raises(MicrobatchLostError):  # a newest it does not know says nothing: lost after the grace
            unknown.result()
    asyncio.run(main())


def _done(**fields: object) -> MicrobatchDone:
    base: dict[str, object] = {"mb_id": "mb", "worker_id": "a0", "results": [], "kv_free_blocks": 1,
                               "kv_total_blocks": 8}
    return MicrobatchDone.model_validate(base | fields)


def test_judge_blames_a_sequence_only_for_its_own_failures() -> None:
    """KV refusals and the blameless codes are sent again uncounted; an error, a timeout and a pass that
    sampled nothing count against the sequence; a lost microbatch is no one's fault."""
    ok = {"seq_id": "s0", "token_id": 7}
    judged = recovery.judge(_done(results=[ok], failed_seq_ids=["s1", "s2", "s3"],
                                  failed_codes={"s2": "sequence_busy", "s3": "kv_exhausted"}),
                            ["s0", "s1", "s2", "s3"], [True, True, True, True], "f0", 5.0, "mb")
    assert [(v.ok, v.blamed, v.code) for v in judged.verdicts] == [
        (True, False, None), (False, False, None), (False, False, "sequence_busy"), (False, True, "kv_exhausted")]
    assert judged.verdicts[0].result is not None and judged.verdicts[0].result.token_id == 7
    assert not judged.whole and judged.unreachable_ffn is None
    nothing_sampled = recovery.judge(_done(results=[{"seq_id": "s0", "token_id": None}]), ["s0"], [True], "f0",
                                     5.0, "mb")
    assert nothing_sampled.whole and not nothing_sampled.verdicts[0].ok and nothing_sampled.verdicts[0].blamed
    timeout = recovery.judge(None, ["s0"], [True], "f0", 5.0, "mb-9")
    assert timeout.verdicts[0].blamed and "no MicrobatchDone for mb-9 within 5.0 s" in timeout.verdicts[0].reason
    lost = recovery.judge(MicrobatchLostError("gone"), ["s0"], [False], "f0", 5.0, "mb")
    assert not lost.verdicts[0].ok and not lost.verdicts[0].blamed and lost.verdicts[0].reason == "gone"


def test_judge_names_an_unreachable_ffn_worker_and_blames_no_sequence() -> None:
    error = {"type": "server_error", "code": "ffn_unreachable", "message": "seam to f1 broken"}
    judged = recovery.judge(_done(error=error), ["s0", "s1"], [True, False], "f1", 5.0, "mb")
    assert judged.unreachable_ffn == "f1" and judged.why == "seam to f1 broken" and not judged.whole
    assert all(not v.ok and not v.blamed and v.reason == "seam to f1 broken" for v in judged.verdicts)
    other = recovery.judge(_done(error=error | {"code": "microbatch_failed"}), ["s0"], [True], "f1", 5.0, "mb")
    assert other.unreachable_ffn is None and other.verdicts[0].blamed


def test_a_request_leaves_its_lane_through_the_lanes_moves_and_owes_a_release_only_where_kv_may_be() -> None:
    """take_back and evacuate on the lane's own moves: off the lists, the reservation dropped, the KV released
    with the next descriptor where the worker may hold it; a handoff (`move`) releases there and runs here."""
    a0, a1 = Worker("a0", "attention"), Worker("a1", "attention")
    a0.lane.block_size = a1.lane.block_size = 16
    held, queued = (RequestState(rid, [1] * 20, SamplingSpec(max_tokens=12), 0.0, worker_id="a0")
                    for rid in ("held", "queued"))
    a0.lane.queue(held, 32)
    a0.lane.queue(queued, 32, front=True)
    a0.lane.admit([held])
    assert list(a0.lane.waiting) == [queued] and a0.lane.running == [held] and held.status is Status.RUNNING
    assert a0.lane.reserved_blocks == {"held": 2, "queued": 2}
    held.num_computed, held.first_pass_sent = 20, True
    assert recovery.take_back(a0, held, failure=True, reason="boom") is None
    assert a0.lane.running == [] and "held" not in a0.lane.reserved_blocks and held.failures == 1
    assert a0.lane.take_releases() == ["held"] and a0.lane.take_releases() == []  # released once
    a0.lane.queue(held, 32)
    a0.lane.admit([held])
    held.worker_id = "a0"
    a0.lane.move(held, a1.lane, 32)  # a P/D handoff: its KV went to a1
    assert a0.lane.running == [] and a1.lane.running == [held] and a1.lane.reserved_blocks == {"held": 2}
    assert a0.lane.take_releases(keep={"held"}) == [] and a0.lane.take_releases() == ["held"]  # kept, then sent
    a0.healthy = False
    a0.lane.lose(restarted=False)
    assert a0.lane.epoch == 1 and recovery.evacuate(a0) == [queued] and queued.worker_id is None
    assert not a0.lane.waiting and a0.lane.reserved_blocks == {}
    assert a0.lane.take_releases() == ["queued"]  # a worker gone silent may hold anything it was sent

"""Membership answers, the scheduler applies: each control event updates the registry and comes back as a
`Change` (lanes to start, workers lost or restarted, requests to route around, clocks to send); and the
one avoidance rule of KV handoffs (recovery.SeamAvoidance)."""

from __future__ import annotations

from services.scheduler.membership import Change, Membership
from services.scheduler.recovery import KV_SEAM_AVOID_S, SeamAvoidance
from services.scheduler.registry import Registry
from services.scheduler.state import RequestState
from shared.error_types import KV_HANDOFF_UNREACHABLE, ErrorType
from shared.messages import (
    ErrorBody,
    Heartbeat,
    KVHandoffReply,
    Register,
    RegisterReply,
    SamplingSpec,
    decode,
    encode,
)


def _register(worker_id: str, role: str = "attention") -> bytes:
    return encode(Register(worker_id=worker_id, role=role, model_id="m", n_layers=2, kv_total_blocks=64,
                           block_size=16, max_seq_len=1024))


def test_a_registration_starts_a_lane_and_a_restart_is_a_loss_to_recompute() -> None:
    registry = Registry()
    membership = Membership(registry, "sched-0", "run1")
    reply, change = membership.register(_register("ffn-0", "ffn"), now=1.0)
    assert decode(RegisterReply, reply).ok and change.start == [] and change.capacity
    reply, change = membership.register(_register("attn-0"), now=1.0)
    attn = registry.workers["attn-0"]
    assert decode(RegisterReply, reply).scheduler_instance == "run1"
    assert change.start == [attn] and change.joined == [attn] and change.clocks == [attn]
    assert change.restarted == [] and change.lost == []
    _, again = membership.register(_register("attn-0"), now=2.0)
    assert again.restarted == [attn]  # registered again: its KV is empty, what it held is recomputed
    assert attn.lane.task is None  # membership starts nothing itself: the scheduler applies the change


def test_a_worker_holding_both_halves_serves_the_whole_model_where_no_ffn_worker_is() -> None:
    """`provision_kinds colocated` (`aflex up` on a CPU host): made colocated on sight, and told so; not where an
    FFN worker is there, and never without that setting (a plan decides)."""
    whole = encode(Register(worker_id="attn-0", role="attention", model_id="m", n_layers=2, kv_total_blocks=64,
                            block_size=16, max_seq_len=1024, halves=["ffn"]))
    registry = Registry()
    _, change = Membership(registry, "sched-0", "run1", colocate_alone=True).register(whole, now=1.0)
    assert registry.workers["attn-0"].assignment == "colocated" and change.whole == [registry.workers["attn-0"]]
    assert registry.ready  # no FFN worker, and ready
    registry = Registry()
    _, change = Membership(registry, "sched-0", "run1").register(whole, now=1.0)
    assert registry.workers["attn-0"].assignment is None and change.whole == [] and not registry.ready
    registry = Registry()
    membership = Membership(registry, "sched-0", "run1", colocate_alone=True)
    membership.register(_register("ffn-0", "ffn"), now=1.0)
    _, change = membership.register(whole, now=1.0)
    assert registry.workers["attn-0"].assignment is None and change.whole == []


def test_a_bad_registration_is_refused_and_changes_nothing() -> None:
    reply, change = Membership(Registry(), "sched-0", "run1").register(b"{not json", now=1.0)
    refused = decode(RegisterReply, reply)
    assert not refused.ok and refused.error is not None and refused.error.type == ErrorType.INVALID_REQUEST
    assert change.joined == [] and not change.capacity and change.start == []


def test_silence_loses_a_worker_and_its_heartbeat_brings_capacity_back() -> None:
    registry = Registry()
    membership = Membership(registry, "sched-0", "run1")
    membership.register(_register("attn-0"), now=1.0)
    assert membership.expire(now=2.0, timeout_s=5.0).lost == []
    lost = membership.expire(now=10.0, timeout_s=5.0).lost
    assert [w.worker_id for w in lost] == ["attn-0"] and not lost[0].healthy
    reply, change = membership.heartbeat(Heartbeat(worker_id="attn-0", role="attention", ts=0.0), now=11.0,
                                         in_flight=lambda _: False)
    assert reply is None and change.capacity and [w.worker_id for w in change.start] == ["attn-0"]
    reply, change = membership.heartbeat(Heartbeat(worker_id="attn-9", role="attention", ts=0.0), now=11.0,
                                         in_flight=lambda _: False)
    assert reply is not None and not decode(RegisterReply, reply).ok  # unknown here: asked to register again


def test_a_plan_that_parks_or_makes_a_decode_worker_routes_its_unstarted_requests_away() -> None:
    registry = Registry()
    membership = Membership(registry, "sched-0", "run1")
    for wid in ("attn-0", "attn-1", "attn-2"):
        membership.register(_register(wid), now=1.0)
    parked, decode_only, mixed = (registry.workers[w] for w in ("attn-0", "attn-1", "attn-2"))
    parked.assignment, decode_only.assignment, mixed.assignment = "parked-warm", "decode-attention", "mixed-attention"
    change = membership.plan_changed([parked, decode_only, mixed])
    assert change.reroute == [parked, decode_only] and change.clocks == [parked, decode_only, mixed]
    assert parked not in change.start and mixed in change.start


def _beat(membership: Membership, worker_id: str, role: str, busy: set[str], *, draining: bool = True
          ) -> tuple[RegisterReply | None, Change]:
    reply, change = membership.heartbeat(Heartbeat(worker_id=worker_id, role=role, ts=0.0, draining=draining),
                                         now=2.0, in_flight=busy.__contains__)
    return (None if reply is None else decode(RegisterReply, reply)), change


def test_a_draining_attention_worker_takes_no_new_work_and_is_drained_once_its_lane_is_empty() -> None:
    registry = Registry()
    membership = Membership(registry, "sched-0", "run1")
    for wid, role in (("attn-0", "attention"), ("attn-1", "attention"), ("ffn-0", "ffn")):
        membership.register(_register(wid, role), now=1.0)
    attn = registry.workers["attn-0"]
    running = RequestState("r", [1, 2], SamplingSpec(), 0.0)
    attn.lane.queue(running, 2)
    attn.lane.admit([running])
    reply, change = _beat(membership, "attn-0", "attention", set())
    assert change.reroute == [attn]  # its unstarted requests go elsewhere
    assert reply is not None and reply.ok and reply.drained is False  # r still runs there
    assert attn not in registry.usable_attention() and registry.ready  # attn-1 takes the new ones
    attn.lane.release(running)
    assert _beat(membership, "attn-0", "attention", {"attn-0"})[0].drained is False  # a microbatch in flight
    reply, change = _beat(membership, "attn-0", "attention", set())
    assert reply is not None and reply.drained is True and change.reroute == []  # told once
    assert _beat(membership, "attn-1", "attention", set(), draining=False)[0] is None  # others: no answer
    membership.register(_register("attn-0"), now=3.0)  # a new process under the same id
    assert not attn.draining and attn in registry.usable_attention()


def test_a_draining_ffn_worker_is_drained_once_another_takes_the_microbatches_or_none_are_left() -> None:
    registry = Registry()
    membership = Membership(registry, "sched-0", "run1")
    for wid, role in (("attn-0", "attention"), ("ffn-0", "ffn"), ("ffn-1", "ffn")):
        membership.register(_register(wid, role), now=1.0)
    attn, ffn0, ffn1 = (registry.workers[w] for w in ("attn-0", "ffn-0", "ffn-1"))
    running = RequestState("r", [1, 2], SamplingSpec(), 0.0)
    attn.lane.queue(running, 2)
    attn.lane.admit([running])
    assert _beat(membership, "ffn-0", "ffn", {"ffn-0"})[0].drained is False  # its hops are in flight
    assert _beat(membership, "ffn-0", "ffn", set())[0].drained is True  # ffn-1 takes the next ones
    assert all(registry.next_ffn() is ffn1 for _ in range(3))
    assert _beat(membership, "ffn-1", "ffn", set())[0].drained is False  # the last one: r still needs it
    assert not registry.ready and registry.has_ffn(attn)  # no new requests; r runs on
    assert registry.next_ffn() in (ffn0, ffn1)
    attn.lane.release(running)
    assert _beat(membership, "ffn-1", "ffn", set())[0].drained is True


def test_a_kv_seam_out_of_reach_is_avoided_for_a_while_and_other_failures_are_not() -> None:
    avoidance = SeamAvoidance()
    unreachable = KVHandoffReply(handoff_id="h1", ok=False, error=ErrorBody(
        type=ErrorType.SERVER_ERROR, message="no seam", code=KV_HANDOFF_UNREACHABLE))
    other = KVHandoffReply(handoff_id="h2", ok=False, error=ErrorBody(type=ErrorType.SERVER_ERROR, message="x"))
    avoidance.handoff_failed("attn-1", other, now=100.0)
    avoidance.handoff_failed("attn-2", None, now=100.0)
    assert not avoidance.avoided("attn-1", 100.1) and not avoidance.avoided("attn-2", 100.1)
    avoidance.handoff_failed("attn-1", unreachable, now=100.0)
    assert avoidance.avoided("attn-1", 100.0 + KV_SEAM_AVOID_S - 0.1)
    assert not avoidance.avoided("attn-1", 100.0 + KV_SEAM_AVOID_S)

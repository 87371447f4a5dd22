"""The closed vocabularies: each tuple spells its Literal's words, in one place, and the parking states map
onto the parked assignments."""

from __future__ import annotations

from typing import get_args

from shared.kinds import (
    ASSIGNMENTS,
    CLOCK_PHASES,
    PARKED,
    PARKED_ASSIGNMENT,
    PARKING_CHOICES,
    PLAN_KINDS,
    Assignment,
    ClockPhase,
    ParkedState,
    ParkingChoice,
    PlanKind,
    decodes_only,
    prefills_only,
    runs_own_ffn,
)


def test_each_tuple_holds_its_literals_words() -> None:
    assert PLAN_KINDS == get_args(PlanKind) == ("pd", "mixed", "colocated", "pd-colocated")
    assert PARKING_CHOICES == get_args(ParkingChoice) == ("auto", "warm", "cold")
    assert get_args(Assignment) == ASSIGNMENTS and get_args(ClockPhase) == CLOCK_PHASES


def test_every_parking_state_has_its_parked_assignment() -> None:
    assert tuple(PARKED_ASSIGNMENT) == get_args(ParkedState) and set(get_args(ParkedState)) < set(PARKING_CHOICES)
    assert PARKED == ("parked-warm", "parked-cold") and set(PARKED) <= set(ASSIGNMENTS)


def test_each_assignment_says_where_its_ffn_runs_and_which_phases_it_serves() -> None:
    """A whole-model worker runs its own FFN in any pool; P/D pools of either sort hand sequences on."""
    own = {a for a in ASSIGNMENTS if runs_own_ffn(a)}
    assert own == {"colocated", "prefill-colocated", "decode-colocated"}
    assert {a for a in ASSIGNMENTS if prefills_only(a)} == {"prefill-attention", "prefill-colocated"}
    assert {a for a in ASSIGNMENTS if decodes_only(a)} == {"decode-attention", "decode-colocated"}
    assert not any(runs_own_ffn(a) or prefills_only(a) or decodes_only(a) for a in (None, *PARKED, "ffn"))

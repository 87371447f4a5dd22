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
)


def test_each_tuple_holds_its_literals_words() -> None:
    assert PLAN_KINDS == get_args(PlanKind) == ("pd", "mixed", "colocated")
    assert PARKING_CHOICES == get_args(ParkingChoice) == ("auto", "warm", "cold")
    assert get_args(Assignment) == ASSIGNMENTS and get_args(ClockPhase) == CLOCK_PHASES


def test_every_parking_state_has_its_parked_assignment() -> None:
    assert tuple(PARKED_ASSIGNMENT) == get_args(ParkedState) and set(get_args(ParkedState)) < set(PARKING_CHOICES)
    assert PARKED == ("parked-warm", "parked-cold") and set(PARKED) <= set(ASSIGNMENTS)

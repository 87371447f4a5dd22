"""The mesh's closed vocabularies, declared once: phases, roles, finish reasons, plan kinds and parking.

Pure typing, no imports of the project: every layer (messages, the seam's frame header, the GPU
controller, the predictors, the policy) names a phase or a role from here, so a new word is added
in one place and mypy finds every match that misses it.
"""

from __future__ import annotations

from typing import Literal

Phase = Literal["prefill", "decode", "mixed"]  # an iteration's or a microbatch's phase
ClockPhase = Literal["prefill", "decode"]  # a phase with a clock of its own (mixed runs at prefill's)
CLOCK_PHASES: tuple[ClockPhase, ...] = ("prefill", "decode")
Role = Literal["attention", "ffn"]  # the half of the model a worker serves
FinishReason = Literal["stop", "length", "abort", "error"]
# the shapes a provisioning plan takes (shared/policy/footprint.py): split P/D pools, one mixed A/F pool,
# whole-model replicas, or P/D pools of whole-model replicas (BiScale's, DistServe's instances); the
# simulator's planner and the live scheduler weigh the same kinds
PlanKind = Literal["pd", "mixed", "colocated", "pd-colocated"]
PLAN_KINDS: tuple[PlanKind, ...] = ("pd", "mixed", "colocated", "pd-colocated")
# where a GPU out of the plan waits (warm: model kept, lowest clock; cold: weights released), and what an
# operator may ask for: one of them, or "auto" (the break-even rule, `shared.policy.parking_rule.parking_state`)
ParkedState = Literal["warm", "cold"]
ParkingChoice = Literal["auto", "warm", "cold"]
PARKING_CHOICES: tuple[ParkingChoice, ...] = ("auto", "warm", "cold")
# what the global scheduler assigns a worker each provisioning window (issue 26): the pool it serves in,
# or where it waits while parked (`PARKED_ASSIGNMENT`: its parking state's)
# ("-colocated": an attention worker running both halves itself, in a colocated pool or a P/D pool of replicas)
Assignment = Literal["prefill-attention", "decode-attention", "mixed-attention", "ffn", "colocated",
                     "prefill-colocated", "decode-colocated", "parked-warm", "parked-cold"]
ASSIGNMENTS: tuple[Assignment, ...] = ("prefill-attention", "decode-attention", "mixed-attention", "ffn",
                                       "colocated", "prefill-colocated", "decode-colocated", "parked-warm",
                                       "parked-cold")
PARKED_ASSIGNMENT: dict[ParkedState, Assignment] = {"warm": "parked-warm", "cold": "parked-cold"}
PARKED: tuple[Assignment, ...] = tuple(PARKED_ASSIGNMENT.values())


def clock_phase(phase: str) -> ClockPhase:
    """The clock a pass runs at: decode's for a pure decode pass, prefill's for prefill or mixed."""
    return "decode" if phase == "decode" else "prefill"


def runs_own_ffn(assignment: str | None) -> bool:
    """An attention worker assigned to run the FFN half itself (a whole-model replica): no FFN worker, no hop."""
    return assignment in ("colocated", "prefill-colocated", "decode-colocated")


def prefills_only(assignment: str | None) -> bool:
    """In a P/D plan's prefill pool: its sequences move to the decode pool once prefilled."""
    return assignment in ("prefill-attention", "prefill-colocated")


def decodes_only(assignment: str | None) -> bool:
    """In a P/D plan's decode pool: it takes handed-off sequences and no new prompt."""
    return assignment in ("decode-attention", "decode-colocated")

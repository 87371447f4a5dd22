"""Where a GPU outside a provisioning plan waits: the one rule for every policy that scales, the live
scheduler's and the simulator's alike.

Warm: its context and model kept, the clock at the minimum; cold: the context released, bare idle, and a
model load to come back (docs/architecture.md, "Parking").
"""

from __future__ import annotations

from shared.kinds import PARKING_CHOICES, ParkedState, ParkingChoice


def parking_state(choice: ParkingChoice, expected_parked_s: float, warm_w: float, cold_w: float,
                  cold_rejoin_j: float) -> ParkedState:
    """Where a GPU leaving the plan waits: `choice` if "warm" or "cold"; "auto" parks cold when the power
    saved over the time it is expected to stay out pays for the model load that brings it back. Checked at
    run time too: a choice may come from an untyped config."""
    if choice not in PARKING_CHOICES:
        raise ValueError(f"unknown parking state {choice!r}; known: {', '.join(PARKING_CHOICES)}")
    if choice != "auto":
        return choice
    return "cold" if expected_parked_s * (warm_w - cold_w) > cold_rejoin_j else "warm"

"""Where a GPU outside a provisioning plan waits: the one rule for every policy that scales, the live
scheduler's and the simulator's alike.

Warm: its context and model kept, the clock at the minimum; cold: the context released, bare idle, and a
model load to come back (docs/architecture.md, "Parking").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.kinds import PARKING_CHOICES, ParkedState, ParkingChoice
from shared.model.sizes import attention_weight_bytes, ffn_weight_bytes

if TYPE_CHECKING:
    from shared.gpu.emulated import GPUProfile
    from shared.model.config import ModelArgs


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


def model_parking_state(choice: ParkingChoice, profile: GPUProfile, args: ModelArgs,
                        expected_parked_s: float) -> ParkedState:
    """`parking_state` for a GPU of `profile` serving `args`: coming back cold costs the context-idle
    power over `cold_rejoin_s` of one role's weights (the mean of the two halves')."""
    rejoin_j = profile.context_idle_power_w * profile.cold_rejoin_s(
        (attention_weight_bytes(args) + ffn_weight_bytes(args)) / 2)
    return parking_state(choice, expected_parked_s, profile.warm_parked_power_w, profile.idle_power_w, rejoin_j)


def parked_power_w(state: ParkedState, profile: GPUProfile) -> float:
    """What a parked GPU draws: warm, the clock locked at its minimum; cold, bare idle."""
    return profile.idle_power_w if state == "cold" else profile.warm_parked_power_w

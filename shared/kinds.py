"""The mesh's closed vocabularies, declared once: phases, roles and finish reasons.

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
# what the global scheduler assigns a worker each provisioning window (issue 26): the pool it serves in,
# or where it waits while parked (warm: model kept, lowest clock; cold: weights released)
Assignment = Literal["prefill-attention", "decode-attention", "mixed-attention", "ffn", "colocated",
                     "parked-warm", "parked-cold"]
ASSIGNMENTS: tuple[Assignment, ...] = ("prefill-attention", "decode-attention", "mixed-attention", "ffn",
                                       "colocated", "parked-warm", "parked-cold")
PARKED: tuple[Assignment, ...] = ("parked-warm", "parked-cold")


def clock_phase(phase: str) -> ClockPhase:
    """The clock a pass runs at: decode's for a pure decode pass, prefill's for prefill or mixed."""
    return "decode" if phase == "decode" else "prefill"

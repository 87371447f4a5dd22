"""The supervisor's vocabulary: a child to run, and what its death hooks are told."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

Role = Literal["scheduler", "attention-worker", "ffn-worker", "gateway"]


@dataclass(frozen=True)
class ChildSpec:
    """One service to run: a display name (the output prefix), its role, its argv and its settings (env)."""

    name: str
    role: Role
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the supervisor's environment


@dataclass(frozen=True)
class ChildExit:
    """What the `on_child_death` hooks receive."""

    name: str
    role: Role
    pid: int
    returncode: int
    killed: bool  # True when the supervisor had to SIGKILL it (it could not clean up after itself)


ChildDeathHook = Callable[[ChildExit], None]

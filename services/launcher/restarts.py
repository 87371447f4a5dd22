"""`aflex up`'s restart rule: compose's `restart: on-failure`, with backoff, giving up on a crash loop.

A service that exits non-zero (a crash, a signal) is started again after a backoff that doubles with
each crash in a row; a crash that comes soon after its start counts towards giving up, one after a
long run starts the count again. A clean exit (status 0) is not a failure and is not restarted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    backoff_first_s: float = 0.5  # before the first restart; doubled for each crash in a row
    backoff_max_s: float = 8.0
    fast_crash_s: float = 10.0  # a crash this soon after its start is part of a crash loop
    max_fast_crashes: int = 5  # crashes in a row, each fast, after which the service is given up on


class Restarts:
    """The crash counts of each service (by name) under one `RestartPolicy`."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.in_a_row: dict[str, int] = {}  # fast crashes in a row, by service name

    def delay_s(self, name: str, returncode: int, ran_s: float) -> float | None:
        """Seconds to wait before starting `name` again; None: not again (a clean exit, or a crash loop)."""
        if returncode == 0:
            return None
        p = self.policy
        crashes = self.in_a_row.get(name, 0) + 1 if ran_s < p.fast_crash_s else 1
        self.in_a_row[name] = crashes
        if crashes > p.max_fast_crashes:
            return None
        return min(p.backoff_max_s, p.backoff_first_s * 2 ** (crashes - 1))

"""The short fault campaign (benchmarks/chaos.py, seed 1, ~60 s of load) on the tiny checkpoint: kills and
hangs of every worker, the scheduler and either gateway while a mixed load runs. Every request ends with
its no-fault answer, token for token (or a typed error), none is lost or hung, and the mesh serves in the
recovery phase. The ten-minute campaign and its figures: docs/reliability.md.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.chaos import campaign
from tools.chaos.campaign import Plan

PLAN = Plan(seed=1, standard_s=10.0, fault_s=45.0, recovery_s=10.0, concurrency=3, fault_gap_s=4.0, bound_s=120.0)


def test_a_short_campaign_loses_nothing(tiny_chat_checkpoint: Path) -> None:
    report = campaign(str(tiny_chat_checkpoint), PLAN)
    totals, faults, phases = report["totals"], report["faults"], report["phases"]
    failures = [f for phase in phases.values() for f in phase["failures"]]
    assert failures == []
    assert totals == {**totals, "lost": 0, "hung": 0, "mismatched": 0, "bad_usage": 0}
    assert faults["injected"] >= 5, faults
    assert {"kill", "hang"} <= set(faults["by_kind"]), faults
    assert all(phase["by_status"].get("ok", 0) > 0 for phase in phases.values()), phases
    assert report["mesh"]["aflex_up_exited"] is None

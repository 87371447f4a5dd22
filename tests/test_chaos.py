"""The short fault campaign (benchmarks/chaos.py, seed 1, ~40 s of load) on the tiny checkpoint: kills and
hangs of every worker, the scheduler and either gateway, and kills aimed at a seam peer mid-hop, a KV
handoff and a role change, while a mixed load runs on P/D pools. Every request ends with its no-fault
answer, token for token (streams: each token once, then `[DONE]`), or a typed error; none is lost or hung,
and the mesh serves in the recovery phase. The ten-minute campaign and its figures: docs/reliability.md.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.chaos import campaign
from tools.chaos.campaign import Plan
from tools.chaos.faults import TARGETED

PLAN = Plan(seed=1, standard_s=5.0, fault_s=28.0, recovery_s=5.0, concurrency=3, fault_gap_s=3.0, bound_s=120.0)


def test_a_short_campaign_loses_nothing(tiny_chat_checkpoint: Path) -> None:
    report = campaign(str(tiny_chat_checkpoint), PLAN)
    totals, faults, phases = report["totals"], report["faults"], report["phases"]
    failures = [f for phase in phases.values() for f in phase["failures"]]
    assert failures == []
    assert totals == {**totals, "lost": 0, "hung": 0, "mismatched": 0, "bad_usage": 0}
    assert faults["injected"] >= 5, faults
    assert {"kill", "hang"} <= set(faults["by_kind"]), faults
    hit = [f for f in faults["list"] if f["kind"] in TARGETED and not f["skipped"]]
    assert hit and all(f["moment"] and f["target"] in f["moment"] for f in hit), faults["list"]
    assert all(phase["by_status"].get("ok", 0) > 0 for phase in phases.values()), phases
    assert report["mesh"]["aflex_up_exited"] is None

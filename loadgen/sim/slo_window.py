"""The SLO figures a simulated planner reads over a stretch of the replay: what the live scheduler reads from
its first tokens and finished requests (services/scheduler/fleet_plan.py), from the replay's arrays.

Times are seconds from the trace's start; a request not yet at its first token or its end holds NaN there.
"""

from __future__ import annotations

import numpy as np


def p90_ttft_ms(arrived_s: np.ndarray, first_s: np.ndarray, t0: float, t1: float) -> float | None:
    """The P90 TTFT of the requests whose first token came in [t0, t1) (None: none did)."""
    sel = (first_s >= t0) & (first_s < t1)
    return float(np.percentile((first_s[sel] - arrived_s[sel]) * 1e3, 90)) if sel.any() else None


def stretch_tpot_met(arrived_s: np.ndarray, first_s: np.ndarray, finish_s: np.ndarray, output_tokens: np.ndarray,
                     t0: float, t1: float, tpot_slo_s: float) -> bool:
    """Whether the requests that arrived in [t0, t1) and finished by t1 met the P90 TPOT SLO (True: none did).
    TTFT is not judged here: its misses come with bursts the forecast missed, which the headroom answers."""
    done = (arrived_s >= t0) & (arrived_s < t1) & (finish_s < t1) & (output_tokens > 1)
    tpot_s = (finish_s[done] - first_s[done]) / (output_tokens[done] - 1)
    return bool(not done.any() or np.percentile(tpot_s, 90) <= tpot_slo_s)

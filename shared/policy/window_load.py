"""The load a provisioning window plans for, from the arrivals it saw: one rule for the simulator and the mesh.

The global controller provisions for the bursts it saw, not their average: with `burst` the rate is
the `quantile` of the window's `subwindow_s` sub-window rates (when the window holds at least 1.5 of
them), never below its mean. The simulator reads a trace's arrays (`loadgen.sim.planning`); the live
scheduler the requests it admitted (`services.scheduler.fleet_plan`). Same arrivals, same load.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shared.policy.pool_sizing import WindowLoad

IDLE_RATE_RPS = 0.05  # the rate a window with no arrivals is planned for (the smallest plan serves it)


def window_load(time_s: np.ndarray | Sequence[float], prompt: np.ndarray | Sequence[float],
                output: np.ndarray | Sequence[float], t0: float, t1: float, *, burst: bool = False,
                subwindow_s: float = 30.0, quantile: float = 0.9,
                idle_prompt: float = 1.0, idle_output: float = 1.0) -> WindowLoad:
    """The load of the arrivals in [t0, t1) (`time_s` sorted; `prompt`/`output` tokens per arrival). A
    window without arrivals is planned at `IDLE_RATE_RPS` with the idle prompt and output lengths."""
    times = np.asarray(time_s, dtype=float)
    t0 = max(0.0, t0)
    i0, i1 = np.searchsorted(times, [t0, t1])
    k = int(i1 - i0)
    if k == 0:
        return WindowLoad(IDLE_RATE_RPS, idle_prompt, idle_output)
    rate = k / max(t1 - t0, 1e-9)
    if burst and t1 - t0 > 1.5 * subwindow_s:
        edges = np.arange(t0, t1 + 1e-9, subwindow_s)
        counts = np.diff(np.searchsorted(times, edges))
        rate = max(rate, float(np.quantile(counts / subwindow_s, quantile)))
    prompts = np.asarray(prompt, dtype=float)[i0:i1]
    outputs = np.asarray(output, dtype=float)[i0:i1]
    return WindowLoad(rate, float(np.mean(prompts)), float(np.mean(outputs)), float(np.percentile(prompts, 90)))

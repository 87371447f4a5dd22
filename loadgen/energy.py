"""Energy, power and clocks from the mesh's telemetry (`aflex.v1.telemetry.>`) during a run.

Workers publish `WorkerTelemetry` about 10 times a second with a monotonic `energy_j` counter. The
energy of a run is, summed over workers, the counter's value at the first sample received at or
after the end minus its value at the last sample received at or before the start (a worker first
seen during the run counts from its first sample). A counter that went down (a restarted worker)
leaves that worker out, with a note. Sample times are the load generator's receive times, so that
clocks of other hosts do not matter. Any subscriber may read these subjects (docs/protocol.md).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from shared import subjects


@dataclass(frozen=True)
class Sample:
    t: float  # time.perf_counter() when received
    worker_id: str
    role: str
    energy_j: float
    power_w: float
    clock_mhz: int
    target_clock_mhz: int | None


@dataclass
class EnergyResult:
    energy_j: float | None
    per_worker_j: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def run_energy(samples: list[Sample], t_start: float, t_end: float) -> EnergyResult:
    by_worker: dict[str, list[Sample]] = {}
    for s in sorted(samples, key=lambda s: s.t):
        by_worker.setdefault(s.worker_id, []).append(s)
    result = EnergyResult(None)
    for wid, series in by_worker.items():
        before = [s for s in series if s.t <= t_start]
        after = [s for s in series if s.t >= t_end]
        inside = [s for s in series if t_start < s.t < t_end]
        first = before[-1] if before else (inside or after)[0]
        last = after[0] if after else (inside or before)[-1]
        if not after:
            result.notes.append(f"{wid}: no telemetry after the run ended; counted to its last sample")
        delta = last.energy_j - first.energy_j
        if delta < 0:
            result.notes.append(f"{wid}: energy counter went down ({first.energy_j} -> {last.energy_j}); left out")
            continue
        result.per_worker_j[wid] = delta
    if result.per_worker_j:
        result.energy_j = float(sum(result.per_worker_j.values()))
    return result


class TelemetryRecorder:
    """Subscribes to the mesh's worker telemetry and keeps every sample."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples: list[Sample] = []
        self._nc: Any = None

    async def start(self, settle_s: float = 0.5) -> None:
        from shared.transport import bus

        self._nc = await bus.connect(self.url, "aflex-loadgen")
        await self._nc.subscribe(subjects.TELEMETRY_ALL, cb=self._on_message)
        await asyncio.sleep(settle_s)  # a baseline sample from every worker (10 Hz telemetry)

    async def _on_message(self, msg: Any) -> None:
        from shared.messages import ProtocolError, WorkerTelemetry, decode

        if ".telemetry.scheduler." in msg.subject:
            return
        try:
            t = decode(WorkerTelemetry, msg.data)
        except ProtocolError:
            return
        self.samples.append(Sample(time.perf_counter(), t.worker_id, t.role, t.energy_j, t.power_w, t.clock_mhz,
                                   t.target_clock_mhz))

    async def finish(self, t_end: float, wait_s: float = 1.0) -> None:
        """Wait until every worker seen has a sample after `t_end` (at most `wait_s`), then disconnect."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            workers = {s.worker_id for s in self.samples}
            done = {s.worker_id for s in self.samples if s.t >= t_end}
            if workers and workers <= done:
                break
            await asyncio.sleep(0.05)
        if self._nc is not None:
            from shared.transport import bus

            await bus.close(self._nc)
            self._nc = None

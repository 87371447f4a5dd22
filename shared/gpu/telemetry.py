"""What a worker publishes about its GPU and its work: a cheap meter and a periodic publisher.

The worker updates a `WorkerMeter` on its hot path (a few float additions per operator call, no
pydantic); `publish_loop` turns the meter into a `WorkerTelemetry` message every 1/hz seconds on
`aflex.v1.telemetry.<role>.<wid>`. Per period:

- `utilization` = modelled GPU-busy seconds / period length (clamped to 1). The modelled time is
  what `GPU.run` returns: the emulated backend's roofline time, or the measured time on a real GPU.
- `latency_ms[phase]` = mean modelled time of one operator call of that phase (a layer's attention
  on an attention worker, one FFN forward on an FFN worker), with the call count.
- `energy_j`, `tokens_done` and `microbatches_done` are monotonic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from shared.gpu.base import GPU
from shared.kinds import Assignment, Role
from shared.messages import DeviceReading, PhaseLatency, WorkerTelemetry, encode

if TYPE_CHECKING:
    from nats.aio.client import Client

    from shared.gpu.controller import DVFSController

log = logging.getLogger("aflex.gpu.telemetry")


class WorkerMeter:
    """Counters a worker updates as it works; `snapshot` reads and restarts the period."""

    def __init__(self, worker_id: str, role: Role, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.worker_id, self.role = worker_id, role
        self._clock = clock
        self._period_start = clock()
        self.busy_s = 0.0  # measured host seconds computing, this period
        self.modelled_s = 0.0  # modelled GPU seconds, this period
        self._phase: dict[str, list[float]] = {}  # phase -> [modelled seconds, calls], this period
        self.tokens_done = 0
        self.microbatches_done = 0
        self.queue_depth = 0
        self.kv_blocks_used = 0
        self.kv_blocks_total = 0
        self.assignment: Assignment | None = None  # the global scheduler's latest (None: none received)
        # rank 0 of a worker group: its device, and the other ranks' latest readings (rank_group.py keeps them)
        self.device = ""
        self.followers: list[DeviceReading] = []
        self.group_traffic: dict[str, dict[str, list[int]]] = {}  # rank 0's collectives (device_group.Traffic)

    def op(self, phase: str, measured_s: float, modelled_s: float) -> None:
        """One operator call (a layer's attention, an FFN forward, the lm_head) on the GPU."""
        self.busy_s += measured_s
        self.modelled_s += modelled_s
        acc = self._phase.get(phase)
        if acc is None:
            self._phase[phase] = [modelled_s, 1.0]
        else:
            acc[0] += modelled_s
            acc[1] += 1.0

    def busy(self, measured_s: float, modelled_s: float) -> None:
        """GPU time not attributed to a phase's latency (embedding, lm_head and sampling)."""
        self.busy_s += measured_s
        self.modelled_s += modelled_s

    def done(self, tokens: int, microbatches: int = 1) -> None:
        self.tokens_done += tokens
        self.microbatches_done += microbatches

    def kv(self, used_blocks: int, total_blocks: int) -> None:
        self.kv_blocks_used, self.kv_blocks_total = used_blocks, total_blocks

    def snapshot(self, gpu: GPU, controller: DVFSController | None = None, *, ts: float | None = None
                 ) -> WorkerTelemetry:
        """The telemetry of the period since the last snapshot; starts a new period."""
        now = self._clock()
        period = max(now - self._period_start, 1e-9)
        latency = {phase: PhaseLatency(mean_ms=acc[0] / acc[1] * 1e3, count=int(acc[1]))
                   for phase, acc in self._phase.items() if acc[1] > 0}
        utilization = min(1.0, max(0.0, self.modelled_s / period))
        self._period_start, self.busy_s, self.modelled_s, self._phase = now, 0.0, 0.0, {}
        power_w, energy_j, devices = gpu.power_w(), gpu.total_energy_j(), list(self.followers)
        if devices:  # a group: rank 0's own reading first, the sums over every rank's
            devices.insert(0, DeviceReading(rank=0, device=self.device, clock_mhz=gpu.sm_clock_mhz(),
                                            power_w=power_w, energy_j=energy_j))
            power_w, energy_j = sum(d.power_w for d in devices), sum(d.energy_j for d in devices)
        return WorkerTelemetry(
            worker_id=self.worker_id, role=self.role, ts=time.time() if ts is None else ts,
            gpu_backend=gpu.backend, gpu_name=gpu.name, clock_mhz=gpu.sm_clock_mhz(),
            target_clock_mhz=controller.target_clock_mhz if controller is not None else None,
            command_applied=controller.applied if controller is not None else True,
            power_w=power_w, energy_j=energy_j, utilization=utilization, devices=devices,
            latency_ms=latency, queue_depth=self.queue_depth, kv_blocks_used=self.kv_blocks_used,
            kv_blocks_total=self.kv_blocks_total, tokens_done=self.tokens_done,
            microbatches_done=self.microbatches_done, assignment=self.assignment,
            group_traffic={op: {kind: list(v) for kind, v in list(kinds.items())}  # another thread adds to it
                           for op, kinds in list(self.group_traffic.items())})


async def publish_loop(nc: Client, subject: str, meter: WorkerMeter, gpu: GPU,
                       controller: DVFSController | None, hz: float, stop: asyncio.Event) -> None:
    """Publish `meter`'s snapshot on `subject` every 1/hz seconds until `stop` is set.

    Each tick first lets the controller follow a new command or an expiry (`poll`), so the reported
    clock follows a command within one period even when the worker is idle.
    """
    if hz <= 0:
        return
    period = 1.0 / hz
    next_at = time.monotonic()
    while not stop.is_set():
        next_at += period
        delay = next_at - time.monotonic()
        if delay < -period:  # fell behind (a long blocking compute): do not burst
            next_at, delay = time.monotonic(), 0.0
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            if stop.is_set():
                return
        try:
            if controller is not None:
                controller.poll()
            await nc.publish(subject, encode(meter.snapshot(gpu, controller)))
        except Exception as exc:  # telemetry must never take the worker down
            log.debug("telemetry on %s not published: %s", subject, exc)

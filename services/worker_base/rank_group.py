"""Rank 0 of a worker group: it starts the other ranks, forms the group with them, and keeps them waiting.

A worker started with a group size above 1 (`--attention-tp`, `--ffn-tp`, `--ffn-ep`) is rank 0: the
group's face on NATS. It opens the group's store, starts ranks 1..N-1 on this host (the same command
and settings, with `AFLEX_GROUP_RANK`, `AFLEX_GROUP_ADDRESS` and the rank's own `AFLEX_DEVICE`; or they
are started elsewhere, `--no-group-spawn`), loads its own share while they load theirs, then forms the
group (shared/transport/device_group.py). A keeper thread asks the others for their GPU readings every
second (READINGS: rank 0's telemetry reports each device and the group's sums), which also keeps an
idle follower's wait for the next step short of the group's timeout: it ends only when rank 0 is gone.

A broken group is not mended in place: a rank that died fails rank 0's next step at once, one that hangs
fails it after `group_timeout_s`; the step fails (the scheduler recomputes it, as for a lost hop) and rank 0
exits (`abandon`: status GROUP_BROKEN_EXIT), taking the ranks it started with it, so that its supervisor
(`aflex up`, compose's restart policy, Kubernetes) starts the whole group again. A follower whose rank 0
is gone exits too: its wait fails the same way.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from services.worker_base.gpu import WorkerGPU
from shared.gpu.telemetry import WorkerMeter
from shared.messages import DeviceReading, FrequencyCommand
from shared.settings import WorkerSettings
from shared.settings_flags import env_of
from shared.transport.device_group import STOP, Command, DeviceGroup, GroupError

log = logging.getLogger("aflex.group")

FOLLOWER_EXIT_S = 10.0  # how long stopped followers may take to exit before they are killed
READINGS_PERIOD_S = 1.0  # how often rank 0 asks the others for their GPU readings (telemetry, aflex top)
READINGS = "readings"
GROUP_BROKEN_EXIT = 75  # rank 0's exit status when its group broke: a failure, so it is started again


def _die_with_parent() -> None:
    """Linux: a follower started here is killed when rank 0 dies, even by SIGKILL, even while stopped."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def rank_device(device: str, rank: int) -> str:
    """Rank `rank`'s device: the `rank`-th GPU from the group's first (`cuda:2` -> `cuda:3` for rank 1);
    every rank of a CPU group computes on the CPU."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return device
    return f"cuda:{(int(index) if index else 0) + rank}"


def clock_state(worker_gpu: WorkerGPU) -> dict[str, Any]:
    """Rank 0's clock command as it holds it, for the followers to hold the same."""
    c = worker_gpu.controller
    return {"clocks": c.phase_clocks_mhz, "valid_until_ts": c.valid_until_ts, "issued_ts": c.issued_ts}


def follow_clocks(worker_gpu: WorkerGPU, state: dict[str, Any]) -> None:
    """Hold the clock command rank 0 holds (one issued before the held one is ignored, as on rank 0)."""
    issued = state["issued_ts"]
    if issued is None or issued == -math.inf or issued <= worker_gpu.controller.issued_ts:
        return
    worker_gpu.controller.apply_command(FrequencyCommand(
        worker_id=worker_gpu.worker_id, clocks_mhz=state["clocks"], valid_until_ts=state["valid_until_ts"],
        issued_ts=issued, reason="group"))


def reading_slots(rank: int, size: int, worker_gpu: WorkerGPU) -> list[float]:
    """READINGS' answer: this rank's clock, power and energy in its slots of a vector the ranks sum."""
    values = [0.0] * (3 * size)
    gpu = worker_gpu.gpu
    values[3 * rank:3 * rank + 3] = [float(gpu.sm_clock_mhz()), gpu.power_w(), gpu.total_energy_j()]
    return values


def follow_commands(group: DeviceGroup, worker_gpu: WorkerGPU, do: Callable[[Command], None]) -> None:
    """A follower's life in its group: each command of rank 0's done in order (READINGS answered here), until
    STOP or a broken group; its GPU's clock reset and the GPU closed however it ends."""
    try:
        while True:
            command = group.receive()
            if command.op == STOP:
                return
            if command.op == READINGS:
                group.sum_floats(reading_slots(group.rank, group.size, worker_gpu))
            else:
                do(command)
    finally:
        worker_gpu.controller.reset()
        worker_gpu.gpu.close()


def group_energy_j(worker_gpu: WorkerGPU | None, leader: GroupLeader | None) -> float | None:
    """A worker's GPU energy counter for its heartbeat: a group's devices' summed (None: no GPU yet)."""
    if worker_gpu is None:
        return None
    return worker_gpu.gpu.total_energy_j() + (leader.followers_energy_j() if leader is not None else 0.0)


def group_devices(settings: WorkerSettings, size: int) -> list[str]:
    """The devices of a group's ranks, rank 0's first ([] for a worker of one device)."""
    return [rank_device(settings.device, rank) for rank in range(size)] if size > 1 else []


class GroupLeader:
    """Rank 0's side: `open` (the store, and the followers started), `form` (the group), `close`."""

    def __init__(self, settings: WorkerSettings, command: str, size: int) -> None:
        self.settings, self.command, self.size = settings, command, size
        self.group: DeviceGroup | None = None
        self.address = ""
        self.followers: list[subprocess.Popen[bytes]] = []
        self._store: object = None
        self._stopping = threading.Event()
        self._keeper: threading.Thread | None = None
        self.readings: list[DeviceReading] = []  # the other ranks' latest GPU readings
        self._loads = 0  # the weights loaded again (`reload`)
        self.meter: WorkerMeter | None = None  # rank 0's telemetry, which reports them

    def open(self) -> None:
        """The group's store, and ranks 1..N-1 started on this host (unless they are started elsewhere)."""
        s = self.settings
        from shared.transport.torch_seam import local_host_towards

        advertise = s.seam_host or local_host_towards(s.nats_url)
        self._store, self.address = DeviceGroup.open_store(port=s.group_port, advertise=advertise)
        log.info("%s: worker group of %d at %s", s.worker_id, self.size, self.address)
        if not s.group_spawn:
            return
        values = s.model_dump()
        for rank in range(1, self.size):
            env = {**os.environ, **env_of(values), "AFLEX_GROUP_RANK": str(rank), "AFLEX_GROUP_ADDRESS": self.address,
                   "AFLEX_DEVICE": rank_device(s.device, rank), "AFLEX_WORKER_ID": f"{s.worker_id}-rank{rank}"}
            self.followers.append(subprocess.Popen([sys.executable, "-m", "services.launcher.cli", self.command],
                                                   env=env, preexec_fn=_die_with_parent))

    def form(self) -> DeviceGroup:
        """Rank 0's side of the rendezvous (blocks until every rank has loaded and come, or fails)."""
        s = self.settings
        try:
            self.group = DeviceGroup(self._store, 0, self.size, torch.device(s.device), s.group_timeout_s,
                                     self.address, host=self.address.split("//")[1].rsplit(":", 1)[0])
        except GroupError:
            self.close()
            raise
        self._keeper = threading.Thread(target=self._keep, name="group-keeper", daemon=True)
        self._keeper.start()
        return self.group

    def form_with(self, load: Callable[[], None]) -> DeviceGroup:
        """`open`, this rank's share loaded (`load`) while the others load theirs, then `form`."""
        self.open()
        try:
            load()
        except BaseException:
            self.close()
            raise
        return self.form()

    def tell(self, op: str, **args: Any) -> bool:
        """A command with no step of rank 0's (LOAD, RELEASE) to the followers, once the group is formed and
        whole; False when there is none to tell."""
        group = self.group
        if group is None or group.broken:
            return False
        with group.lock:
            group.send(op, **args)
        return True

    def reload(self, op: str, load: Callable[[], None]) -> None:
        """Load the weights again on every rank (`op`: the followers' LOAD), rank 0's by `load`, and wait, as
        long as loading takes, until every rank has: the next step's collectives would time out first."""
        self._loads += 1
        tag = f"load-{self._loads}"
        told = self.tell(op, tag=tag)
        load()
        if told:
            assert self.group is not None
            self.group.barrier(tag)

    def _keep(self) -> None:
        """Every READINGS_PERIOD_S: the other ranks' GPU readings, for rank 0's telemetry (`meter`). Idle, this is
        also what keeps a follower's wait for the next step short of the group's timeout."""
        group = self.group
        assert group is not None
        period_s = min(READINGS_PERIOD_S, self.settings.group_timeout_s / 3)
        while not self._stopping.wait(period_s):
            if group.broken:
                continue
            with group.lock:
                try:
                    group.send(READINGS)
                    values = group.sum_floats([0.0] * (3 * self.size))
                except GroupError as exc:
                    self.abandon(exc)
            s = self.settings
            self.readings = [DeviceReading(rank=r, device=rank_device(s.device, r), clock_mhz=int(values[3 * r]),
                                           power_w=values[3 * r + 1], energy_j=values[3 * r + 2])
                             for r in range(1, self.size)]
            if self.meter is not None:
                self.meter.followers = self.readings

    def report_to(self, meter: WorkerMeter) -> None:
        """Rank 0's telemetry reports the group's devices (`WorkerMeter.followers`)."""
        meter.device = self.settings.device
        if self.group is not None:
            meter.group_traffic = self.group.traffic.by_op
        self.meter = meter

    def followers_energy_j(self) -> float:
        """The other ranks' GPU energy counters at their last readings, summed."""
        return sum(r.energy_j for r in self.readings)

    def abandon(self, reason: BaseException) -> None:
        """The group broke: end this process now (and the ranks it started), so the group is started again."""
        log.error("%s: worker group broken (%s): exiting so that it is started again", self.settings.worker_id,
                  reason)
        for follower in self.followers:
            with contextlib.suppress(ProcessLookupError):
                follower.kill()
        logging.shutdown()
        os._exit(GROUP_BROKEN_EXIT)

    def check(self, exc: BaseException) -> None:
        """After a failed step: `abandon` when it failed because the group broke."""
        if isinstance(exc, GroupError) or (self.group is not None and self.group.broken):
            self.abandon(exc)

    def close(self) -> None:
        """Stop the keeper, tell the followers to exit, and make sure the ones started here do."""
        self._stopping.set()
        if self.group is not None:
            self.group.close()
        deadline = time.monotonic() + FOLLOWER_EXIT_S
        for follower in self.followers:
            if self.group is None or self.group.broken:
                with contextlib.suppress(ProcessLookupError):
                    follower.send_signal(signal.SIGTERM)
            try:
                follower.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                follower.kill()
                follower.wait()
        self.followers.clear()

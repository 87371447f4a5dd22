"""The fault campaign's faults, injected into a running `aflex up` by process: kill, hang, a NATS node lost.

- `kill`: SIGKILL of a child of `aflex up` (a worker, the scheduler, a gateway); `aflex up` starts it
  again after its backoff, as compose's `restart: on-failure` does.
- `hang`: SIGSTOP, a pause of 0-5 s, SIGCONT: the process is alive but silent (a GC pause, a stuck driver).
- `nats-node`: SIGKILL of a node of `aflex up --nats-cluster 3`, started again here after 1-3 s with its own
  command line and environment (`aflex up` does not restart nats-servers); the restarted node is this
  module's to stop (`Injector.close`).
Each injection returns a `Fault` record; a target not running at that moment (it is being restarted) is
recorded as skipped, not retried.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.launch import Mesh

HANG_MAX_S = 5.0
NATS_DOWN_S = (1.0, 3.0)


@dataclass
class Fault:
    kind: str  # kill, hang, nats-node
    target: str
    at: float  # time.monotonic() it was injected
    skipped: str = ""  # why it was not injected
    hang_s: float = 0.0
    recovered_s: float | None = None  # until a request sent after it completed whole (the campaign fills it in)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "target": self.target, "at": round(self.at, 3), "skipped": self.skipped,
                "hang_s": round(self.hang_s, 2), "recovered_s": self.recovered_s}


@dataclass
class Injector:
    mesh: Mesh
    targets: list[str]  # children of `aflex up`: worker ids, "scheduler", "gateway:<port>"
    rng: random.Random
    nats_cluster: bool = False
    restarted_nodes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)

    def kinds(self) -> list[str]:
        return ["kill", "hang", *(["nats-node"] if self.nats_cluster else [])]

    def inject(self, kind: str) -> Fault:
        now = time.monotonic()
        if kind == "nats-node":
            return self._nats_node(now)
        target = self.rng.choice(self.targets)
        fault = Fault(kind, target, now)
        try:
            pid = self.mesh.pid_of(target)
        except LookupError:
            fault.skipped = "not running (being restarted)"
            return fault
        if kind == "kill":
            _signal(pid, signal.SIGKILL)
        else:
            fault.hang_s = self.rng.uniform(0.0, HANG_MAX_S)
            _signal(pid, signal.SIGSTOP)
            self._later(fault.hang_s, lambda: _signal(pid, signal.SIGCONT))
        return fault

    def _nats_node(self, now: float) -> Fault:
        pids = [n.pid for n in self.mesh.nats_nodes()] + [p.pid for p in self.restarted_nodes if p.poll() is None]
        if len(pids) < 3:
            return Fault("nats-node", "", now, skipped=f"{len(pids)} nodes up: one is still coming back")
        pid = self.rng.choice(pids)
        fault = Fault("nats-node", f"pid {pid}", now)
        proc = Path(f"/proc/{pid}")
        argv = [a.decode() for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
        env = dict(e.decode().split("=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
        cwd = os.readlink(proc / "cwd")
        _signal(pid, signal.SIGKILL)
        self._later(self.rng.uniform(*NATS_DOWN_S), lambda: self.restarted_nodes.append(
            subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
        return fault

    def _later(self, delay_s: float, action: Any) -> None:
        def run() -> None:
            time.sleep(delay_s)
            action()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self._threads.append(thread)

    def close(self) -> None:
        """Let every pending SIGCONT and restart happen, then stop the NATS nodes started here."""
        for thread in self._threads:
            thread.join()
        for node in self.restarted_nodes:
            node.terminate()
        for node in self.restarted_nodes:
            try:
                node.wait(10)
            except subprocess.TimeoutExpired:
                node.kill()


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # gone meanwhile (it crashed, or was killed): nothing to do
        os.kill(pid, sig)

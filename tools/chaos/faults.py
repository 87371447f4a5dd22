"""The fault campaign's faults, injected into a running `aflex up` by process: kill, hang, a NATS node lost.

- `kill`: SIGKILL of a child of `aflex up` (a worker, the scheduler, a gateway); `aflex up` starts it
  again after its backoff, as compose's `restart: on-failure` does.
- `hang`: SIGSTOP, a pause of 0-5 s, SIGCONT: the process is alive but silent (a GC pause, a stuck driver).
- `rank-kill`, `rank-hang` (a mesh of worker groups): SIGKILL, or SIGSTOP for 0-5 s, of a rank other than
  rank 0 of a group: rank 0's next step fails (at once, or after the group's timeout), it exits and
  `aflex up` starts the whole group again (docs/architecture.md, "Worker groups").
- `nats-node`: SIGKILL of a node of `aflex up --nats-cluster 3`, started again here after 1-3 s with its own
  command line and environment (`aflex up` does not restart nats-servers); the restarted node is this
  module's to stop (`Injector.close`).
- targeted, at a moment heard on NATS (watch.py), SIGKILL of one of its two ends, picked at random:
  `seam-peer` when a microbatch starts (its attention worker or the FFN worker its hops go to: the other
  one's seam peer is gone mid-hop); `handoff` when a KV handoff starts (the prefill or the decode worker);
  `role-change` when a plan changes workers' assignments (one of the changed workers, mid-change). Where no
  plan changed within `PROVOKE_AFTER_S`, a random worker is stopped first for `PROVOKE_HANG_S`: taken for
  lost, it changes the plan (a worker killed comes back too soon for that, as one and the same worker).
Each injection returns a `Fault` record; a target not running at that moment (it is being restarted), or a
moment that did not come within `TARGET_WAIT_S`, is recorded as skipped, not retried.
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

from tools.chaos.watch import Watch
from tools.launch import Mesh

HANG_MAX_S = 5.0
NATS_DOWN_S = (1.0, 3.0)
TARGET_WAIT_S = 15.0  # a targeted fault whose moment did not come by then is skipped
PROVOKE_AFTER_S = 5.0  # a role-change fault with no plan change by then makes one: it stops a worker for
PROVOKE_HANG_S = 8.0  # this long, past the scheduler's `heartbeat_timeout_s` (5 s): it is taken for lost
TARGETED = {"seam-peer": Watch.microbatch, "handoff": Watch.handoff, "role-change": Watch.role_change}


@dataclass
class Fault:
    kind: str  # kill, hang, rank-kill, rank-hang, nats-node, or a targeted one (seam-peer, handoff, role-change)
    target: str
    at: float  # time.monotonic() it was injected
    skipped: str = ""  # why it was not injected
    hang_s: float = 0.0
    moment: str = ""  # targeted: what it hit
    after_ms: float = 0.0  # targeted: from hearing the moment to the signal
    provoked_by: str = ""  # role-change: the worker stopped first to make the plan change
    key: str = ""  # targeted: the microbatch's or handoff's id
    evidence: str = ""  # targeted: the mesh's first log line saying it failed (benchmarks/chaos.py fills it in)
    answered_s: float | None = None  # until a request sent after it completed whole (the campaign fills these in)
    recovered_s: float | None = None  # until the mesh served at the standard phase's rate again

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "target": self.target, "at": round(self.at, 3), "skipped": self.skipped,
                "hang_s": round(self.hang_s, 2), "moment": self.moment, "after_ms": round(self.after_ms, 2),
                "provoked_by": self.provoked_by, "evidence": self.evidence,
                "answered_s": self.answered_s, "recovered_s": self.recovered_s}


@dataclass
class Injector:
    mesh: Mesh
    targets: list[str]  # children of `aflex up`: worker ids, "scheduler", "gateway:<port>"
    rng: random.Random
    nats_cluster: bool = False
    watch: Watch | None = None  # targeted faults: where their moments are heard
    groups: dict[str, int] = field(default_factory=dict)  # worker groups: rank 0's worker id -> its ranks
    restarted_nodes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)

    def kinds(self) -> list[str]:
        return ["kill", "hang", *(["nats-node"] if self.nats_cluster else []),
                *(["rank-kill", "rank-hang"] if self.groups else []), *(TARGETED if self.watch is not None else [])]

    async def inject_targeted(self, kind: str, until: float) -> Fault:
        """Wait for `kind`'s moment (until `until` at the latest, time.monotonic()), then SIGKILL one of its two
        ends (their pids found beforehand: a scan of /proc takes milliseconds; the kill must land in the moment)."""
        assert self.watch is not None
        pids = {}
        for worker in self.targets:
            with contextlib.suppress(LookupError):
                pids[worker] = self.mesh.pid_of(worker)
        provoked = ""

        def wait_s(most_s: float) -> float:
            return max(0.0, min(most_s, until - time.monotonic()))

        moment = await TARGETED[kind](self.watch, wait_s(PROVOKE_AFTER_S if kind == "role-change" else TARGET_WAIT_S))
        if moment is None and kind == "role-change" and pids and wait_s(TARGET_WAIT_S) > 0:
            # no plan changed of itself: a worker taken for lost does it
            provoked = self.rng.choice(sorted(w for w in pids if w != "scheduler" and not w.startswith("gateway")))
            stopped = pids.pop(provoked)
            _signal(stopped, signal.SIGSTOP)
            self._later(PROVOKE_HANG_S, lambda: _signal(stopped, signal.SIGCONT))
            moment = await TARGETED[kind](self.watch, wait_s(TARGET_WAIT_S))
        if moment is None:
            return Fault(kind, "", time.monotonic(), provoked_by=provoked,
                         skipped=f"no {kind} moment within {TARGET_WAIT_S:g} s or before the phase ended")
        target = self.rng.choice([w for w in moment.workers if w in pids] or moment.workers)  # not the stopped one
        pid = pids.get(target)
        if pid is not None:
            _signal(pid, signal.SIGKILL)
        now = time.monotonic()
        return Fault(kind, target, now, moment=moment.what, after_ms=(now - moment.heard_at) * 1e3,
                     provoked_by=provoked, key=moment.key,
                     skipped="" if pid is not None else "not running (being restarted)")

    def inject(self, kind: str) -> Fault:
        now = time.monotonic()
        if kind == "nats-node":
            return self._nats_node(now)
        target = self.rng.choice(sorted(self.groups) if kind.startswith("rank-") else self.targets)
        rank = self.rng.randrange(1, self.groups[target]) if kind.startswith("rank-") else 0
        fault = Fault(kind, f"{target} rank {rank}" if rank else target, now)
        try:
            pid = self.mesh.rank_pid(target, rank) if rank else self.mesh.pid_of(target)
        except LookupError:
            fault.skipped = "not running (being restarted)"
            return fault
        if kind in ("kill", "rank-kill"):
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

"""`aflex up` as a subprocess, for end-to-end tests and benchmarks: start it on free ports, wait
until it says it is serving (after the gateway's `/ready`; only from then on does it restart what
crashes), stop it with SIGTERM (SIGKILL after a minute)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.launcher.supervisor import SERVING_ANNOUNCEMENT
from shared.transport.nats_server import EmbeddedNatsServer, free_port

if TYPE_CHECKING:
    from shared.messages import PlanTelemetry


@dataclass(frozen=True)
class NatsNode:
    """One nats-server of a mesh: its pid, client port and monitoring port."""

    pid: int
    port: int
    monitor_port: int

    def client_names(self) -> list[str]:
        """The names of the clients connected to it now (`/connz`)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/connz?limit=1024", timeout=5) as response:
            return [str(c.get("name", "")) for c in json.load(response).get("connections") or []]


class Mesh:
    """A running `aflex up`: its process, the gateway's and the nats-server's ports, its output so far."""

    def __init__(self, process: subprocess.Popen[str], port: int, nats_port: int, log: list[str]) -> None:
        self.process, self.port, self.nats_port, self.log = process, port, nats_port, log

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def telemetry_url(self) -> str:
        """Where outside subscribers read telemetry: the read-only user `aflex up` printed, if it made one."""
        for line in self.log:
            if "telemetry subscribers: " in line:
                return line.split("telemetry subscribers: ", 1)[1].strip()
        return f"nats://127.0.0.1:{self.nats_port}"

    def served_model(self) -> str:
        """The model id the gateway serves (what clients send as `model`)."""
        with urllib.request.urlopen(f"{self.base_url}/models", timeout=10) as response:
            return str(json.load(response)["data"][0]["id"])

    def pid_of(self, name: str) -> int:
        """The pid of `aflex up`'s child `name`: a service ("scheduler", "gateway"), a worker id, or the
        gateway on a port ("gateway:8001")."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                status = (entry / "status").read_text()
                environ = (entry / "environ").read_bytes().split(b"\0")
                argv = [a.decode() for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
            except OSError:
                continue
            ppid = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:"))
            service, _, port = name.partition(":")
            if ppid == self.process.pid and (
                    (argv[-1:] == [service] and (not port or f"AFLEX_PORT={port}".encode() in environ))
                    or f"AFLEX_WORKER_ID={name}".encode() in environ):
                return int(entry.name)
        raise LookupError(f"no child {name!r} of aflex up ({self.process.pid})")

    def rank_pid(self, worker_id: str, rank: int = 1) -> int:
        """The pid of rank `rank` of the worker group whose rank 0 is `worker_id` (it started the others)."""
        leader = self.pid_of(worker_id)
        for entry in Path("/proc").iterdir():
            try:
                status = (entry / "status").read_text() if entry.name.isdigit() else ""
                environ = (entry / "environ").read_bytes().split(b"\0") if status else []
            except OSError:
                continue
            ppid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:")), 0)
            if ppid == leader and f"AFLEX_GROUP_RANK={rank}".encode() in environ:
                return int(entry.name)
        raise LookupError(f"{worker_id} (pid {leader}) has no rank {rank}")

    def nats_nodes(self) -> list[NatsNode]:
        """The nats-servers `aflex up` started (one, or a cluster's nodes), from their config files."""
        nodes = []
        for entry in Path("/proc").iterdir():
            try:
                argv = [a.decode() for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
                status = (entry / "status").read_text()
            except OSError:
                continue
            ppid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:")), 0)
            if ppid != self.process.pid or not argv or not argv[0].endswith("nats-server") or "-c" not in argv:
                continue
            conf = dict(line.split(": ", 1) for line in Path(argv[argv.index("-c") + 1]).read_text().splitlines()
                        if line.startswith(("listen: ", "http: ")))
            nodes.append(NatsNode(int(entry.name), int(conf["listen"].rsplit(":", 1)[1]),
                                  int(conf["http"].rsplit(":", 1)[1])))
        return sorted(nodes, key=lambda node: node.port)

    def nats_node_of(self, client: str) -> NatsNode:
        """The nats-server the client named `client` (e.g. "aflex-gateway") is connected to now."""
        nodes = [node for node in self.nats_nodes() if client in node.client_names()]
        if len(nodes) != 1:
            raise LookupError(f"{client} is connected to {len(nodes)} nats-servers of aflex up")
        return nodes[0]

    def rss_mb(self, name: str) -> float:
        """Resident memory of the child `name`, MiB."""
        status = Path(f"/proc/{self.pid_of(name)}/status").read_text()
        return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) / 1024

    def output(self) -> str:
        return "".join(self.log)


GATEWAY_PORTS = 4  # `--gateways N` serves on --port, --port + 1, ...: this many are found free together


def _free_port_run(count: int) -> int:
    """A port free with the `count - 1` after it (a client's ephemeral port took a second gateway's once)."""
    while True:
        port = free_port()
        try:
            for offset in range(1, count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        return port


@contextmanager
def aflex_up(model: str, *extra: str, timeout_s: float = 300.0, nats_url: str | None = None,
             env_extra: dict[str, str] | None = None, open_nats: bool = False, split: bool = True) -> Iterator[Mesh]:
    """`nats_url`: use that server (`AFLEX_NATS_URL`) instead of the embedded one `aflex up` starts;
    `open_nats`: start one without users here (a benchmark that watches every subject), and use it;
    `env_extra`: settings every service gets (`AFLEX_*` variables); `split`: attention and FFN workers apart
    (`--ffn-workers 1` unless `extra` says how), not `aflex up`'s CPU-host default of the whole model in one
    worker (`split=False`: exactly what a user's `aflex up` starts)."""
    if split and not {"--ffn-workers", "--provision-kinds"} & set(extra):
        extra = (*extra, "--ffn-workers", "1")
    if open_nats and nats_url is None:
        with EmbeddedNatsServer() as server, aflex_up(model, *extra, timeout_s=timeout_s, nats_url=server.url,
                                                      env_extra=env_extra, split=split) as mesh:
            mesh.nats_port = server.port
            yield mesh
        return
    port = _free_port_run(GATEWAY_PORTS)
    nats_port = free_port()
    while port <= nats_port < port + GATEWAY_PORTS:
        nats_port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "AFLEX_NATS_URL"} | (env_extra or {})
    if nats_url is not None:
        env["AFLEX_NATS_URL"] = nats_url
    process = subprocess.Popen(
        [sys.executable, "-m", "services.launcher.cli", "up", "--model", model, "--host", "127.0.0.1",
         "--port", str(port), "--nats-port", str(nats_port), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=Path(__file__).parent.parent,
    )
    log: list[str] = []
    assert process.stdout is not None
    stdout = process.stdout
    threading.Thread(target=lambda: log.extend(iter(stdout.readline, "")), daemon=True).start()
    mesh = Mesh(process, port, nats_port, log)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"aflex up exited with {process.returncode}:\n{mesh.output()}")
            if SERVING_ANNOUNCEMENT in mesh.output():  # aflex up's own word: it now restarts what crashes
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"mesh not ready within {timeout_s} s:\n{mesh.output()}")
            time.sleep(0.2)
        yield mesh
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def until_plan(mesh: Mesh, wanted: Callable[[PlanTelemetry], bool], deadline_s: float = 120.0
                     ) -> PlanTelemetry:
    """The first plan of the global scheduler that is `wanted` (a mesh started with `open_nats`, so that its
    telemetry can be read without a password)."""
    import asyncio

    from shared import subjects
    from shared.messages import PlanTelemetry, decode
    from shared.transport import bus

    nc = await bus.connect(f"nats://127.0.0.1:{mesh.nats_port}", "aflex-plan-watch")
    found: asyncio.Future[PlanTelemetry] = asyncio.get_running_loop().create_future()

    async def on_plan(msg: object) -> None:
        plan = decode(PlanTelemetry, msg.data)  # type: ignore[attr-defined]
        if wanted(plan) and not found.done():
            found.set_result(plan)

    await nc.subscribe(subjects.TELEMETRY_PLAN, cb=on_plan)
    try:
        return await asyncio.wait_for(found, deadline_s)
    finally:
        await nc.close()


async def until_pd_plan(mesh: Mesh, deadline_s: float = 120.0) -> PlanTelemetry:
    """Until the global scheduler's plan has a prefill and a decode pool: attention workers beside FFN workers
    (a "pd" plan), or whole-model workers ("pd-colocated")."""
    def pd(p: PlanTelemetry) -> bool:
        held = set(p.assignments.values())
        return {"prefill-attention", "decode-attention"} <= held or {"prefill-colocated", "decode-colocated"} <= held

    return await until_plan(mesh, pd, deadline_s)

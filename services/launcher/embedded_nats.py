"""The NATS that `aflex up` brings: one embedded nats-server, or a cluster of them, with a user per role.

Each child gets its role's user and password in its settings, and with a cluster its own order of the
nodes, so the services spread over them and each fails over to the next when its node dies. With
`AFLEX_NATS_URL` set, none is started: the services use that one (a server or a cluster's list).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.launcher.children import ChildSpec
from shared.settings_flags import env_of
from shared.transport import nats_auth
from shared.transport.bus import server_list
from shared.transport.nats_server import EmbeddedNatsCluster, EmbeddedNatsServer


class UpNats:
    """The embedded server(s) (none for an outside NATS) and what each child is told about them."""

    def __init__(self, env: dict[str, str], port: int, cluster_size: int) -> None:
        self.outside_url = env.get("AFLEX_NATS_URL", "")
        self.passwords: dict[str, str] = {} if self.outside_url else nats_auth.new_credentials()
        self.server: EmbeddedNatsServer | EmbeddedNatsCluster | None = None
        if not self.outside_url:
            self.server = (EmbeddedNatsServer(port=port or None, users=self.passwords) if cluster_size <= 1 else
                           EmbeddedNatsCluster(cluster_size, first_port=port or None, users=self.passwords))

    @property
    def url(self) -> str:
        return self.outside_url or (self.server.url if self.server is not None else "")

    def start(self) -> None:
        if self.server is None:
            say(f"using NATS at {self.outside_url}")
            return
        self.server.start()
        if isinstance(self.server, EmbeddedNatsCluster):
            say(f"nats-server cluster of {len(self.server.nodes)} nodes at {self.url}, a user per role")
        else:
            say(f"nats-server at {self.url}, a user per role")
        telemetry = ",".join(nats_auth.url_for(url, "telemetry", self.passwords["telemetry"])
                             for url in server_list(self.url))
        say(f"telemetry subscribers: {telemetry}")

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def for_children(self, specs: Sequence[ChildSpec]) -> list[ChildSpec]:
        """Each child with its role's user and, on a cluster, the nodes listed from its own (i-th) on."""
        return [self._for_child(spec, i) for i, spec in enumerate(specs)]

    def _for_child(self, spec: ChildSpec, i: int) -> ChildSpec:
        settings: dict[str, object] = {}
        user = nats_auth.SERVICE_ROLES.get(spec.role)
        if self.passwords and user is not None:
            settings |= {"nats_user": user, "nats_password": self.passwords[user]}
        if isinstance(self.server, EmbeddedNatsCluster):
            settings["nats_url"] = self.server.rotated_url(i)
        if not settings:
            return spec
        return ChildSpec(spec.name, spec.role, spec.argv, {**spec.env, **env_of(settings)})


def say(line: str) -> None:
    print(f"aflex up: {line}", file=sys.stderr, flush=True)

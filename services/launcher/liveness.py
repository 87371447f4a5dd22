"""`aflex liveness SERVICE`: is a service that serves no HTTP (the scheduler, a worker) still alive?

Kubernetes runs it as the exec probe of the scheduler's and the workers' containers (deploy/helm/aflex). It is
a subcommand of the image, not a file the chart mounts, so that it reads the service's settings exactly as
the service does (the same package, the same `AFLEX_*` environment: shared/settings.py) and ships with it.

Each of them publishes telemetry from its event loop: a worker `WorkerTelemetry` on
aflex.v1.telemetry.<attention|ffn>.<worker id> (AFLEX_TELEMETRY_HZ, 10 a second by default), the scheduler
`SchedulerTelemetry` on aflex.v1.telemetry.scheduler.<scheduler id> (1 a second). The probe listens on that
subject as the read-only telemetry user (PROBE_NATS_USER, PROBE_NATS_PASSWORD: not settings, no service reads
them) with nats-py. Exit status:

  0  a message came within --wait seconds (at least three telemetry periods); or NATS cannot be reached
     (restarting the service would not bring NATS back: the service reconnects by itself); or the service
     publishes no telemetry (AFLEX_TELEMETRY_HZ=0)
  1  NATS answers but the service has said nothing for --wait seconds: its loop is stuck or its connection gone
"""

from __future__ import annotations

import argparse
import asyncio
import os

import nats
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError

from shared import subjects
from shared.settings import AttentionWorkerSettings, FFNWorkerSettings, SchedulerSettings, ServiceSettings

SERVICES: dict[str, tuple[type[ServiceSettings], str]] = {  # service -> (its settings, its telemetry role)
    "scheduler": (SchedulerSettings, "scheduler"),
    "attention-worker": (AttentionWorkerSettings, "attention"),
    "ffn-worker": (FFNWorkerSettings, "ffn"),
}
CONNECT_TIMEOUT_S = 1.0  # a server on the cluster network answers in milliseconds


async def probe(service: str, wait_s: float) -> int:
    """The exit status for `service`, whose settings come from this process's environment."""
    settings_class, role = SERVICES[service]
    settings = settings_class()
    hz = float(getattr(settings, "telemetry_hz", 0.0))
    if hz <= 0:
        print(f"{service} publishes no telemetry (telemetry_hz={hz:g}): nothing to check")
        return 0
    own_id = str(getattr(settings, "scheduler_id", None) or getattr(settings, "worker_id", ""))
    subject = subjects.telemetry(role, own_id)
    wait_s = max(wait_s, 3.0 / hz)
    refused: list[str] = []

    async def on_error(exc: Exception) -> None:
        if "permissions violation" in str(exc).lower():
            refused.append(str(exc))

    servers = [url.strip() for url in settings.nats_url.split(",") if url.strip()]
    try:  # nats-py may go on trying an unreachable server: bounded here
        nc = await asyncio.wait_for(nats.connect(
            servers=servers, name=f"aflex-liveness-{own_id}", user=os.environ.get("PROBE_NATS_USER", "telemetry"),
            password=os.environ.get("PROBE_NATS_PASSWORD", ""), connect_timeout=CONNECT_TIMEOUT_S,
            allow_reconnect=False, max_reconnect_attempts=0, error_cb=on_error), CONNECT_TIMEOUT_S * len(servers) + 1)
    except (NatsError, OSError, TimeoutError) as exc:
        print(f"NATS not reachable at {settings.nats_url} ({exc!r}): not {service}'s failure")
        return 0
    try:
        subscription = await nc.subscribe(subject)
        try:
            await subscription.next_msg(timeout=wait_s)
        except NatsTimeoutError:
            if refused:  # the probe's own user may not read telemetry: NATS's config, not the service
                print(f"the probe's NATS user may not read {subject}: {refused[0]}")
                return 0
            print(f"{service}: no telemetry on {subject} for {wait_s:g} s")
            return 1
        print(f"{service}: telemetry on {subject}")
        return 0
    finally:
        await nc.close()


def add_liveness_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description, parser.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    parser.add_argument("service", choices=sorted(SERVICES))
    parser.add_argument("--wait", type=float, default=10.0, help="seconds to wait for one telemetry message")


def liveness(args: argparse.Namespace) -> int:
    return asyncio.run(probe(args.service, args.wait))

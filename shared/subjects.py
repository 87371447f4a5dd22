"""Every NATS subject and queue group AFlex uses, in one place, versioned `aflex.v1.…`.

Outside subscribers (dashboards, `aflex top`, recorders) depend on these names: a change here is
a protocol change and goes with a version bump and docs/protocol.md.

Layout, so that NATS per-user permissions can be written by prefix:
    aflex.v1.req.*            gateway <-> scheduler (requests, outputs, cancellation)
    aflex.v1.attn.<wid>.mb    scheduler -> attention worker (microbatch descriptors)
    aflex.v1.attn.<wid>.kv    scheduler -> attention worker (KV handoffs, request/reply)
    aflex.v1.seam.<wid>       seam frames between workers, on the `nats` seam transport only
    aflex.v1.sched.*          workers -> scheduler
    aflex.v1.freq.<wid>       scheduler -> worker (only the scheduler may publish)
    aflex.v1.telemetry.>      anyone may read
    aflex.v1.control.*        worker registration, heartbeats and drains; roles (scheduler -> worker)
"""

from __future__ import annotations

PREFIX = "aflex.v1"

REQ_SUBMIT = f"{PREFIX}.req.submit"
SCHED_DONE = f"{PREFIX}.sched.done"
SCHED_HEARTBEAT = f"{PREFIX}.sched.heartbeat"  # every scheduler, every `heartbeat_s`: gateways watch it
GATEWAY_HEARTBEAT = f"{PREFIX}.gateway.heartbeat"  # every gateway: schedulers cancel a gone one's requests
CONTROL_REGISTER = f"{PREFIX}.control.register"
CONTROL_HEARTBEAT_ALL = f"{PREFIX}.control.heartbeat.*"
CONTROL_DRAIN_ALL = f"{PREFIX}.control.drain.*"
TELEMETRY_ALL = f"{PREFIX}.telemetry.>"

# Queue groups: several schedulers could share submissions (only one runs today).
SCHEDULER_QUEUE = "aflex-scheduler"


def req_out(request_id: str) -> str:
    return f"{PREFIX}.req.{request_id}.out"


def req_cancel(request_id: str) -> str:
    return f"{PREFIX}.req.{request_id}.cancel"


REQ_CANCEL_ALL = f"{PREFIX}.req.*.cancel"


def attn_mb(worker_id: str) -> str:
    return f"{PREFIX}.attn.{worker_id}.mb"


def attn_kv(worker_id: str) -> str:
    """Where the scheduler asks a prefill attention worker to hand a sequence's KV to a decode one."""
    return f"{PREFIX}.attn.{worker_id}.kv"


def seam(worker_id: str) -> str:
    """Where a worker takes seam frames when they travel over NATS (the `nats` seam transport)."""
    return f"{PREFIX}.seam.{worker_id}"


def freq(worker_id: str) -> str:
    return f"{PREFIX}.freq.{worker_id}"


def telemetry(role: str, worker_id: str) -> str:
    return f"{PREFIX}.telemetry.{role}.{worker_id}"


def role(worker_id: str) -> str:
    """Where the scheduler tells a worker its assignment for the provisioning window (only it publishes)."""
    return f"{PREFIX}.control.role.{worker_id}"


TELEMETRY_PLAN = f"{PREFIX}.telemetry.plan"  # the global scheduler's plan, every window and every change


def heartbeat(worker_id: str) -> str:
    return f"{PREFIX}.control.heartbeat.{worker_id}"


def drain(worker_id: str) -> str:
    """Where a stopping worker asks the scheduler whether it is drained: only the scheduler subscribes, so no
    responders means no scheduler (heartbeats are heard by attention workers too, watching the FFN workers')."""
    return f"{PREFIX}.control.drain.{worker_id}"


def check_token(token: str) -> str:
    """Worker and request ids become subject tokens: no dots, spaces or wildcards."""
    if not token or any(c in token for c in ".*> \t\r\n"):
        raise ValueError(f"{token!r} cannot be a NATS subject token")
    return token

SCHED_STATUS = f"{PREFIX}.sched.status"  # request/reply: is the mesh ready, and how loaded

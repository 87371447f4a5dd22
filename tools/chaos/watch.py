"""The moments the campaign's targeted faults wait for, heard on the mesh's own NATS subjects.

- a microbatch starting (`aflex.v1.attn.<wid>.mb`): its attention worker runs every layer's hop to the
  FFN worker it names over the seam, so a kill of either one right then leaves the other's seam peer gone
  mid-hop;
- a KV handoff starting (`aflex.v1.attn.<wid>.kv`, the scheduler's request to the prefill worker): the KV is
  on its way to the decode worker's seam until the prefill worker answers;
- a role change (`aflex.v1.telemetry.plan` with workers in `changed`): the scheduler has just sent each
  changed worker its new assignment, which the worker is applying (parking, loading, taking another pool).

The microbatch and handoff subjects are readable only by the attention role, so the watcher connects as
that user, with the password `aflex up` gave its attention workers (read from a worker's environment, as an
operator with the machine's root could); the plan telemetry through the read-only `telemetry` user. A
subscription exists only while a fault waits (a microbatch every few milliseconds would otherwise cost the
two cores), and adds a reader beside the workers' own: it takes nothing from them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from shared import subjects
from shared.messages import KVHandoff, MicrobatchDescriptor, PlanTelemetry, decode
from shared.transport import bus
from tools.launch import Mesh

CLOSE_WAIT_S = 5.0


@dataclass(frozen=True)
class Moment:
    """What a targeted fault waited for: `workers` are the two ends of it (the first the subject's worker)."""

    what: str  # e.g. "microbatch mb-12 on attn-0 with ffn-1"
    workers: tuple[str, ...]
    heard_at: float  # time.monotonic()
    key: str = ""  # the microbatch's or handoff's id, as the mesh's log lines name it


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


class Watch:
    def __init__(self, mesh: Mesh, attention_worker: str) -> None:
        self.mesh, self.attention_worker = mesh, attention_worker
        self.attention: Client | None = None
        self.telemetry: Client | None = None

    async def open(self) -> None:
        env = _environ(self.mesh.pid_of(self.attention_worker))
        url = env.get("AFLEX_NATS_URL", f"nats://127.0.0.1:{self.mesh.nats_port}")
        self.attention = await bus.connect(url, "aflex-chaos-watch", user=env.get("AFLEX_NATS_USER", ""),
                                           password=env.get("AFLEX_NATS_PASSWORD", ""))
        self.telemetry = await bus.connect(self.mesh.telemetry_url, "aflex-chaos-plan-watch")

    async def close(self) -> None:
        """Close both connections, waiting at most `CLOSE_WAIT_S` for each: nats-py's close can wait on a
        connection it is still trying to restore (a campaign's NATS nodes may all be gone by then)."""
        for nc in (self.attention, self.telemetry):
            if nc is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(nc.close(), CLOSE_WAIT_S)

    async def microbatch(self, timeout_s: float) -> Moment | None:
        def moment(subject: str, data: bytes) -> Moment:
            mb = decode(MicrobatchDescriptor, data)
            wid = subject.split(".")[-2]
            return Moment(f"microbatch {mb.mb_id} on {wid} with {mb.ffn_worker}", (wid, mb.ffn_worker),
                          time.monotonic(), mb.mb_id)
        return await self._first(self.attention, subjects.attn_mb("*"), moment, timeout_s)

    async def handoff(self, timeout_s: float) -> Moment | None:
        def moment(subject: str, data: bytes) -> Moment:
            req = decode(KVHandoff, data)
            wid = subject.split(".")[-2]
            return Moment(f"KV handoff {req.handoff_id} of {req.num_tokens} tokens {wid} -> {req.to_worker}",
                          (wid, req.to_worker), time.monotonic(), req.handoff_id)
        return await self._first(self.attention, subjects.attn_kv("*"), moment, timeout_s)

    async def role_change(self, timeout_s: float) -> Moment | None:
        def moment(subject: str, data: bytes) -> Moment | None:
            plan = decode(PlanTelemetry, data)
            if not plan.changed:
                return None
            moves = ", ".join(f"{w} -> {plan.assignments.get(w, '?')}" for w in plan.changed)
            return Moment(f"plan {plan.plan_id} ({plan.kind}): {moves}", tuple(plan.changed), time.monotonic())
        return await self._first(self.telemetry, subjects.TELEMETRY_PLAN, moment, timeout_s)

    async def _first(self, nc: Client | None, subject: str, moment: Any, timeout_s: float) -> Moment | None:
        """The first message on `subject` that `moment` makes a Moment of, or None after `timeout_s`."""
        assert nc is not None, "Watch.open first"
        found: asyncio.Future[Moment] = asyncio.get_running_loop().create_future()

        async def on_message(msg: Any) -> None:
            if not found.done() and (seen := moment(msg.subject, msg.data)) is not None:
                found.set_result(seen)

        sub = await nc.subscribe(subject, cb=on_message)
        try:
            return await asyncio.wait_for(found, timeout_s)
        except TimeoutError:
            return None
        finally:
            await sub.unsubscribe()

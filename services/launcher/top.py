"""`aflex top`: a live view of the mesh from its telemetry (`aflex.v1.telemetry.>`).

One row per worker (GPU, clock and target, power, energy, joules per token, per-phase latency,
utilisation, queue, KV use), one per scheduler (queue, running, SLO attainment, P90 TTFT/TPOT), and a
cluster total. `--json` prints every telemetry message as one JSON line instead; `--once` prints one
table (or the messages of one interval) and exits.

Energy per token is measured from the moment top first hears a worker: the growth of its energy counter
over the growth of its token counter. The cluster's joules per token divide the energy of every worker by
the tokens of the attention workers (a token passes through one attention worker and the FFN workers, so
counting FFN tokens too would count it twice); with no attention worker in view, by the FFN tokens.

`TopState` does the bookkeeping and knows nothing of terminals or NATS, so it is tested on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

import orjson
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from shared import subjects
from shared.errors import AFlexError
from shared.lifecycle import stop_on_signals
from shared.messages import PlanTelemetry, ProtocolError, SchedulerTelemetry, WorkerTelemetry, decode
from shared.transport.bus import DEFAULT_NATS_URL

STALE_AFTER_S = 5.0  # a worker silent this long is shown dimmed, marked "stale"
CONNECT_TIMEOUT_S = 3.0
SCHEDULER_PREFIX = f"{subjects.PREFIX}.telemetry.scheduler."


@dataclass
class WorkerView:
    """What top knows of one worker: its first and latest telemetry, and when the latest came."""

    first: WorkerTelemetry
    latest: WorkerTelemetry
    seen: float  # monotonic

    @property
    def energy_delta_j(self) -> float:
        return max(0.0, self.latest.energy_j - self.first.energy_j)

    @property
    def tokens_delta(self) -> int:
        return max(0, self.latest.tokens_done - self.first.tokens_done)

    @property
    def joules_per_token(self) -> float | None:
        tokens = self.tokens_delta
        return self.energy_delta_j / tokens if tokens else None


@dataclass(frozen=True)
class ClusterTotals:
    workers: int
    power_w: float
    energy_j: float  # the workers' energy counters, summed
    energy_delta_j: float  # since top started
    tokens_delta: int
    joules_per_token: float | None


class TopState:
    """Aggregates telemetry messages; pure (the clock is passed in), no terminal, no NATS."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerView] = {}
        self.schedulers: dict[str, tuple[float, SchedulerTelemetry]] = {}
        self.plan: PlanTelemetry | None = None  # the global scheduler's latest
        self.messages = 0
        self.invalid = 0

    def update(self, subject: str, data: bytes,
               now: float | None = None) -> WorkerTelemetry | SchedulerTelemetry | PlanTelemetry | None:
        """Record one message; returns it decoded, or None when it is not valid telemetry."""
        now = time.monotonic() if now is None else now
        try:
            if subject == subjects.TELEMETRY_PLAN:
                self.messages += 1
                self.plan = decode(PlanTelemetry, data)
                return self.plan
            if subject.startswith(SCHEDULER_PREFIX):
                return self.add_scheduler(decode(SchedulerTelemetry, data), now)
            return self.add_worker(decode(WorkerTelemetry, data), now)
        except ProtocolError:
            self.invalid += 1
            return None

    def add_worker(self, msg: WorkerTelemetry, now: float) -> WorkerTelemetry:
        self.messages += 1
        view = self.workers.get(msg.worker_id)
        if view is None or msg.energy_j < view.latest.energy_j or msg.tokens_done < view.latest.tokens_done:
            # first sight, or the worker restarted (its monotonic counters went back): measure anew
            self.workers[msg.worker_id] = WorkerView(msg, msg, now)
        else:
            view.latest, view.seen = msg, now
        return msg

    def add_scheduler(self, msg: SchedulerTelemetry, now: float) -> SchedulerTelemetry:
        self.messages += 1
        self.schedulers[msg.scheduler_id] = (now, msg)
        return msg

    def sorted_workers(self) -> list[WorkerView]:
        order = {"attention": 0, "ffn": 1}
        return sorted(self.workers.values(), key=lambda v: (order.get(v.latest.role, 2), v.latest.worker_id))

    def totals(self) -> ClusterTotals:
        views = list(self.workers.values())
        energy_delta = sum(v.energy_delta_j for v in views)
        attention_tokens = sum(v.tokens_delta for v in views if v.latest.role == "attention")
        has_attention = any(v.latest.role == "attention" for v in views)
        tokens = attention_tokens if has_attention else sum(v.tokens_delta for v in views)
        return ClusterTotals(
            workers=len(views), power_w=sum(v.latest.power_w for v in views),
            energy_j=sum(v.latest.energy_j for v in views), energy_delta_j=energy_delta, tokens_delta=tokens,
            joules_per_token=energy_delta / tokens if tokens else None,
        )


# -- rendering ------------------------------------------------------------------------------------


def _num(value: float | None, fmt: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def clock_text(msg: WorkerTelemetry) -> Text:
    """`900`, `900 → 600` while moving to a target, and `(not applied)` when the backend only reads."""
    text = Text(str(msg.clock_mhz))
    if msg.target_clock_mhz is not None and msg.target_clock_mhz != msg.clock_mhz:
        text.append(f" → {msg.target_clock_mhz}")
    if not msg.command_applied:
        text.append(" (not applied)", style="yellow")
    return text


def latency_text(msg: WorkerTelemetry) -> str:
    parts = [f"{phase} {lat.mean_ms:.1f}" for phase, lat in sorted(msg.latency_ms.items()) if lat.count]
    return " · ".join(parts) or "-"


def role_text(msg: WorkerTelemetry) -> str:
    """The half it serves, and the global scheduler's assignment where it says more (`attention (parked-warm)`)."""
    said = msg.assignment
    if said == "colocated":
        return "whole model (colocated)"
    if said in ("prefill-colocated", "decode-colocated"):
        return f"whole model ({said.split('-')[0]} pool)"
    return msg.role if said is None or said in ("ffn", "mixed-attention") else f"{msg.role} ({said})"


def plan_text(plan: PlanTelemetry) -> str:
    """One line for the global scheduler's latest plan: its kind, pools, load and what it changed."""
    pools = ", ".join(f"{name} {'/'.join(map(str, shape))}" for name, shape in plan.pools.items())
    parked = sum(a.startswith("parked") for a in plan.assignments.values())
    changed = f"; changed {', '.join(plan.changed)}" if plan.changed else ""
    power = f", {plan.predicted_power_w:.0f} W predicted" if plan.feasible and plan.predicted_power_w else ""
    return (f"plan {plan.plan_id} ({plan.kind}): {pools}; {parked} parked; for {plan.load_rps:.2f} req/s"
            f"{power}{'' if plan.feasible else ' (infeasible: every worker serves)'}{changed}")


def gpu_text(w: WorkerTelemetry) -> str:
    """The backend and GPU; a group's device count (its power and energy are the group's sums)."""
    text = f"{w.gpu_backend}: {w.gpu_name}" if w.gpu_name else w.gpu_backend
    return f"{text} x{len(w.devices)}" if w.devices else text


def render(state: TopState, now: float | None = None, *, source: str = "") -> RenderableType:
    now = time.monotonic() if now is None else now
    workers = Table(title=f"AFlex workers{f'  ({source})' if source else ''}", title_justify="left",
                    expand=False, show_footer=False)
    for name, justify in [("role", "left"), ("worker", "left"), ("GPU", "left"), ("clock MHz", "right"),
                          ("power W", "right"), ("energy J", "right"), ("J/tok", "right"),
                          ("latency ms", "left"), ("util", "right"), ("queue", "right"), ("KV used/total", "right")]:
        workers.add_column(name, justify=justify)  # type: ignore[arg-type]
    for view in state.sorted_workers():
        w = view.latest
        stale = now - view.seen > STALE_AFTER_S
        workers.add_row(
            role_text(w), w.worker_id + (" (stale)" if stale else ""), gpu_text(w), clock_text(w),
            f"{w.power_w:.1f}", f"{w.energy_j:.1f}",
            _num(view.joules_per_token, ".3f"), latency_text(w), f"{w.utilization:.0%}", str(w.queue_depth),
            f"{w.kv_blocks_used}/{w.kv_blocks_total}" if w.kv_blocks_total else "-",
            style="dim" if stale else None,
        )
    totals = state.totals()
    workers.add_section()
    workers.add_row("cluster", f"{totals.workers} workers", "", "", f"{totals.power_w:.1f}", f"{totals.energy_j:.1f}",
                    _num(totals.joules_per_token, ".3f"), f"{totals.tokens_delta} tokens since start", "", "", "",
                    style="bold")
    parts: list[RenderableType] = [workers]
    sched = Table(title="scheduler", title_justify="left")
    for name in ("scheduler", "queue", "running", "finished", "SLO attainment", "p90 TTFT ms", "p90 TPOT ms"):
        sched.add_column(name, justify="left" if name == "scheduler" else "right")
    for seen, s in sorted(state.schedulers.values(), key=lambda item: item[1].scheduler_id):
        sched.add_row(s.scheduler_id + (" (stale)" if now - seen > STALE_AFTER_S else ""), str(s.queue_depth),
                      str(s.running), str(s.finished), _num(s.slo_attainment, ".1%"), _num(s.ttft_p90_ms),
                      _num(s.tpot_p90_ms))
    if state.schedulers:
        parts.append(sched)
    if state.plan is not None:
        parts.append(Text(plan_text(state.plan)))
    if not state.messages:
        parts.append(Text(f"no telemetry yet on {subjects.TELEMETRY_ALL}", style="yellow"))
    return Group(*parts)


# -- the command ----------------------------------------------------------------------------------


def add_top_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats", default=None,
                        help=f"NATS URL (default: $AFLEX_NATS_URL or {DEFAULT_NATS_URL})")
    parser.add_argument("--json", action="store_true", help="print every telemetry message as one JSON line")
    parser.add_argument("--once", action="store_true", help="print one table after the first interval and exit")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")


class TopConnectError(AFlexError):
    """NATS could not be reached."""


async def _connect(url: str, timeout_s: float) -> Any:
    """Connect, or fail fast: the first failed attempt (or the timeout) is one `TopConnectError`."""
    import nats

    loop = asyncio.get_running_loop()
    first_error: asyncio.Future[Any] = loop.create_future()
    connected = False

    async def error_cb(exc: Exception) -> None:  # nats reports every failed attempt: top says it once
        if not connected and not first_error.done():
            first_error.set_result(exc)

    connecting: asyncio.Future[Any] = asyncio.ensure_future(nats.connect(
        servers=[url], name="aflex-top", connect_timeout=timeout_s, reconnect_time_wait=0.5,
        max_reconnect_attempts=-1, allow_reconnect=True, error_cb=error_cb))
    try:
        await asyncio.wait({connecting, first_error}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not connecting.done():
            connecting.cancel()
            with contextlib.suppress(BaseException):
                await connecting
    if connecting.done() and not connecting.cancelled() and connecting.exception() is None:
        connected = True
        return connecting.result()
    if first_error.done():
        reason = str(first_error.result()) or type(first_error.result()).__name__
    elif connecting.done() and not connecting.cancelled() and connecting.exception() is not None:
        reason = str(connecting.exception()) or type(connecting.exception()).__name__
    else:
        reason = f"no answer within {timeout_s:g} s"
    raise TopConnectError(f"cannot connect to NATS at {url}: {reason}")


async def run_top(url: str, *, json_lines: bool = False, once: bool = False, interval_s: float = 1.0,
                  out: IO[str] | None = None, stop: asyncio.Event | None = None,
                  connect_timeout_s: float = CONNECT_TIMEOUT_S, state: TopState | None = None) -> int:
    """Subscribe and show; returns when `once` is done (its interval passed, or `stop` set before) or `stop`
    is set. `state`: where the messages go (a caller may watch it). Raises `TopConnectError`."""
    out = out or sys.stdout
    stop = stop or asyncio.Event()
    state = state or TopState()
    nc = await _connect(url, connect_timeout_s)

    async def on_message(msg: Any) -> None:
        decoded = state.update(msg.subject, msg.data)
        if json_lines and decoded is not None:
            line = orjson.dumps({"subject": msg.subject, "message": orjson.loads(msg.data)})
            out.write(line.decode() + "\n")
            out.flush()

    try:
        await nc.subscribe(subjects.TELEMETRY_ALL, cb=on_message)
        await nc.flush()
        if once:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            if not json_lines:
                _console(out).print(render(state, source=url))
            return 0
        if json_lines:
            await stop.wait()
            return 0
        from rich.live import Live

        console = _console(out)
        with Live(render(state, source=url), console=console, refresh_per_second=max(1.0, 1 / interval_s),
                  screen=False, transient=False) as live:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=interval_s)
                live.update(render(state, source=url))
        return 0
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


def _console(out: IO[str]) -> Console:
    width = None if out.isatty() else int(os.environ.get("COLUMNS", "160"))
    return Console(file=out, width=width, highlight=False)


async def _main(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    with stop_on_signals(stop):
        return await run_top(args.nats or os.environ.get("AFLEX_NATS_URL") or DEFAULT_NATS_URL,
                             json_lines=args.json, once=args.once, interval_s=args.interval, stop=stop)


def top(args: argparse.Namespace) -> int:
    """`aflex top`: 0 when done, 2 (one line on stderr) when NATS cannot be reached."""
    if args.interval <= 0:
        print("aflex top: error: --interval must be positive", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_main(args))
    except TopConnectError as exc:
        print(f"aflex top: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aflex top", description=__doc__.splitlines()[0] if __doc__ else None)
    add_top_arguments(parser)
    return top(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

"""`aflex up`: the whole mesh on one machine, each service a supervised subprocess.

Subprocesses, not tasks in one loop, so every service runs exactly as in compose and a worker that
crashes or hangs cannot take the others down. It starts NATS, the scheduler, the workers and the
gateway in order, prefixes their output, waits for `/ready`, starts a crashed child again with
backoff (`restarts.py`; the gateway or the scheduler given up on stops everything), and stops all
in order on SIGINT/SIGTERM. The behaviour in full: docs/architecture.md, "`aflex up`".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import IO

from services.launcher.children import ChildDeathHook, ChildExit, ChildSpec, Role
from services.launcher.layout import resolve_layout, workers_text
from services.launcher.restarts import RestartPolicy, Restarts
from services.launcher.worker_gpus import device_env, reset_clock_hook, worker_devices
from shared.errors import AFlexError
from shared.settings import (
    AttentionWorkerSettings,
    FFNWorkerSettings,
    GatewaySettings,
    SchedulerSettings,
    WorkerSettings,
)
from shared.settings_flags import add_flags, env_of

ON_FAILURE = RestartPolicy()  # a crashed child is started again (compose's `restart: on-failure`)
# Children the mesh cannot serve without: if one is given up on, the supervisor stops everything.
CRITICAL_ROLES: frozenset[str] = frozenset({"gateway", "scheduler"})
# Stop order: the gateway first (no new requests), then the scheduler, then the workers.
STOP_ORDER: tuple[str, ...] = ("gateway", "scheduler", "attention-worker", "ffn-worker")
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


SERVING_ANNOUNCEMENT = "AFlex is serving"  # printed once every service is up; from then on crashes are restarted


class SupervisorError(AFlexError):
    """The mesh could not be brought up."""


class ChildDiedError(SupervisorError):
    """A child exited before the mesh was ready."""

    def __init__(self, name: str, returncode: int) -> None:
        super().__init__(f"{name} {describe_status(returncode)} before AFlex was ready")
        self.name = name
        self.returncode = returncode


class ReadinessTimeoutError(SupervisorError):
    """The gateway did not report ready in time."""


CommandBuilder = Callable[[argparse.Namespace], list[ChildSpec]]

# what `aflex up` takes itself and hands down
SCHEDULER_KNOBS = ("microbatch_depth", "batching", "freq_policy", "queue_deadline_s", "provisioning",
                   "provision_window_s", "provision_min_attention", "provision_min_ffn", "provision_kinds",
                   "provision_parking")
GATEWAY_KNOBS = ("api_key",)
WORKER_KNOBS = ("device", "dtype", "quantize", "torch_threads", "seam_transport", "gpu_backend", "gpu_profile",
                "gpu_pace")  # (the flags of both are generated from these settings fields)
ATTENTION_KNOBS = ("colocate", "attention_tp")  # the attention workers' own
FFN_KNOBS = ("ffn_tp", "ffn_ep")  # the FFN workers' own


def describe_status(returncode: int) -> str:
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        return f"exited with status {returncode} ({signal.Signals(-returncode).name})"
    except ValueError:
        return f"exited with status {returncode} (signal {-returncode})"


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()  # resolved here: between fork and exec the child should do as little as possible


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM if the supervisor itself dies (even by SIGKILL).

    The children run in their own process groups, so without this a killed supervisor would leave
    them orphaned and holding GPUs and ports.
    """
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    spec: ChildSpec
    process: subprocess.Popen[bytes]
    threads: list[threading.Thread] = field(default_factory=list)
    reported: bool = False
    started_mono: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return self.spec.name


class Supervisor:
    """Starts, watches and stops the children; knows nothing about NATS or HTTP."""

    def __init__(self, specs: Sequence[ChildSpec], env: dict[str, str] | None = None, *,
                 stdout: IO[str] | None = None, stderr: IO[str] | None = None, grace_s: float = 10.0,
                 on_child_death: Iterable[ChildDeathHook] = (),
                 restart: RestartPolicy | None = ON_FAILURE) -> None:
        self.specs = list(specs)
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the prefixer as they are written
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self.grace_s = grace_s
        self.on_child_death: list[ChildDeathHook] = list(on_child_death)
        self.children: list[Child] = []
        self.restarts = None if restart is None else Restarts(restart)  # None: a dead child stays dead
        self._due: list[tuple[float, Child]] = []  # (when, crashed child) to start again
        self._write_lock = threading.Lock()

    # -- output ------------------------------------------------------------------------------
    def _pump(self, name: str, source: IO[bytes], sink: IO[str]) -> None:
        for raw in iter(source.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            self._write(sink, f"[{name}] {line}")
        source.close()

    def _write(self, sink: IO[str], line: str) -> None:
        with self._write_lock:
            try:
                sink.write(line + "\n")
                sink.flush()
            except (OSError, ValueError):  # a closed or broken terminal must not kill the supervisor
                pass

    def report(self, message: str) -> None:
        self._write(self.stderr, f"aflex up: {message}")

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start every child in the order given (scheduler, workers, gateway by default)."""
        self.children.extend(self._spawn(spec) for spec in self.specs)

    def _spawn(self, spec: ChildSpec) -> Child:
        process = subprocess.Popen(spec.argv, env={**self.env, **spec.env}, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0,
                                   preexec_fn=_die_with_parent)
        child = Child(spec, process)
        for source, sink in ((process.stdout, self.stdout), (process.stderr, self.stderr)):
            assert source is not None
            thread = threading.Thread(target=self._pump, args=(spec.name, source, sink),
                                      name=f"aflex-up-{spec.name}", daemon=True)
            thread.start()
            child.threads.append(thread)
        return child

    def poll(self) -> list[Child]:
        """Children that died since the last poll: reported on stderr and passed to the hooks."""
        dead = []
        for child in self.children:
            if child.reported or child.process.poll() is None:
                continue
            child.reported = True
            for thread in child.threads:  # let its last words out before the death notice
                thread.join(timeout=1.0)
            self.report(f"{child.name} {describe_status(child.process.returncode)}")
            self._run_hooks(child, killed=False)
            dead.append(child)
        return dead

    def _run_hooks(self, child: Child, *, killed: bool) -> None:
        event = ChildExit(child.name, child.spec.role, child.process.pid, int(child.process.returncode), killed)
        for hook in self.on_child_death:
            try:
                hook(event)
            except Exception as exc:  # a failing hook must not stop the others or the shutdown
                self.report(f"on-child-death hook {getattr(hook, '__name__', hook)!r} failed for {child.name}: {exc}")

    def wait_ready(self, probe: Callable[[], bool], timeout_s: float, interval_s: float = 0.25) -> None:
        """Poll `probe` until it returns True; raise ChildDiedError as soon as any child exits."""
        deadline = time.monotonic() + timeout_s
        while True:
            dead = self.poll()
            if dead:
                raise ChildDiedError(dead[0].name, int(dead[0].process.returncode))
            if probe():
                return
            if time.monotonic() >= deadline:
                raise ReadinessTimeoutError(f"AFlex was not ready within {timeout_s:.0f} s")
            time.sleep(interval_s)

    def serve(self, stop: threading.Event, interval_s: float = 0.2) -> int:
        """Watch the children until `stop` is set (0), starting crashed ones again after their backoff;
        1 when one the mesh cannot serve without is given up on, or every child has exited."""
        while not stop.wait(interval_s):
            now = time.monotonic()
            for child in self.poll():
                returncode = int(child.process.returncode)
                delay_s = None if self.restarts is None else self.restarts.delay_s(
                    child.name, returncode, now - child.started_mono)
                if delay_s is not None:
                    self.report(f"restarting {child.name} in {delay_s:g} s")
                    self._due.append((now + delay_s, child))
                    continue
                if self.restarts is not None and returncode != 0:
                    self.report(f"{child.name} crashed {self.restarts.in_a_row[child.name]} times in a row, each "
                                f"within {self.restarts.policy.fast_crash_s:g} s of its start: not restarting it")
                if child.spec.role in CRITICAL_ROLES:
                    self.report(f"{child.name} is needed to serve: stopping AFlex")
                    return 1
            for due in [d for d in self._due if d[0] <= now]:
                self._due.remove(due)
                self.children[self.children.index(due[1])] = self._spawn(due[1].spec)
            if self.children and all(child.reported for child in self.children) and not self._due:
                self.report("every service has exited")
                return 1
        return 0

    def stop(self) -> None:
        """Stop the running children in STOP_ORDER: SIGTERM, wait up to grace_s, then SIGKILL."""
        self._due.clear()  # nothing starts again once stopping
        rank = {role: i for i, role in enumerate(STOP_ORDER)}
        for child in sorted(self.children, key=lambda c: rank.get(c.spec.role, len(rank))):
            process = child.process
            killed = False
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=self.grace_s)
                except subprocess.TimeoutExpired:
                    self.report(f"{child.name} did not stop within {self.grace_s:.0f} s: killing it")
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
                    process.wait()
                    killed = True
            for thread in child.threads:
                thread.join(timeout=1.0)
            if killed:
                child.reported = True
                self._run_hooks(child, killed=True)
            elif not child.reported:
                child.reported = True  # stopped on request: not a death to report


# -- `aflex up` ------------------------------------------------------------------------------
def add_up_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `aflex up`; cli.py registers the subcommand with `set_defaults(func=up)`."""
    parser.add_argument("--model", default="default", help="HF directory, .gguf file, or 'default' (SmolLM2)")
    parser.add_argument("--host", default="127.0.0.1", help="address the gateway listens on")
    parser.add_argument("--port", type=int, default=8000, help="port of the OpenAI API")
    parser.add_argument("--nats-port", type=int, default=4222,
                        help="port of the embedded nats-server (0 picks a free one); unused when AFLEX_NATS_URL is set")
    parser.add_argument("--nats-cluster", type=_positive, default=1, metavar="NODES",
                        help="embedded nats-server nodes, joined by routes on loopback, the services spread "
                             "over them (3 survives losing one)")
    parser.add_argument("--attention-workers", type=_positive, default=1, metavar="N")
    parser.add_argument("--ffn-workers", type=_positive, default=None, metavar="M",
                        help="FFN workers (default: 1; none where the whole model is served in one worker: "
                             "workers on this host's CPU and no --provision-kinds, see `whole_model_here`)")
    parser.add_argument("--gateways", type=_positive, default=1, metavar="G",
                        help="gateways serving the same mesh, on --port, --port + 1, ...")
    # the services' own knobs, declared once in shared/settings.py and handed down as AFLEX_* variables
    add_flags(parser, SchedulerSettings, only=SCHEDULER_KNOBS)
    add_flags(parser, GatewaySettings, only=GATEWAY_KNOBS)
    add_flags(parser, WorkerSettings, only=WORKER_KNOBS, aliases={"gpu_backend": ("--gpu-control",)})
    add_flags(parser, AttentionWorkerSettings, only=ATTENTION_KNOBS)
    add_flags(parser, FFNWorkerSettings, only=FFN_KNOBS)
    parser.add_argument("--ready-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="how long to wait for the gateway's /ready")
    parser.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                        help="how long a child may take to stop after SIGTERM before it is killed")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_commands(args: argparse.Namespace) -> list[ChildSpec]:
    """The real services, in start order: `python -m services.launcher.cli <subcommand>`, each with its settings
    as `AFLEX_*` environment variables (a knob not given is left to the service: its env or default).
    NATS travels the same way, in `AFLEX_NATS_URL` (set by `up`)."""
    args = resolve_layout(args)
    cli = [sys.executable, "-m", "services.launcher.cli"]
    model = {"model": str(args.model)}
    worker = {k: getattr(args, k) for k in WORKER_KNOBS}
    attention = {k: getattr(args, k) for k in ATTENTION_KNOBS}
    ffn = {k: getattr(args, k) for k in FFN_KNOBS}
    names = [f"attn-{i}" for i in range(args.attention_workers)] + [f"ffn-{i}" for i in range(args.ffn_workers)]
    # each worker's devices: one per rank of its group (--attention-tp, --ffn-tp x --ffn-ep)
    ffn_size = (ffn["ffn_tp"] or 1) * (ffn["ffn_ep"] or 1)
    sizes = [(attention["attention_tp"] or 1) if name.startswith("attn") else ffn_size for name in names]
    split_cores = worker["torch_threads"] is None and not os.environ.get("AFLEX_TORCH_THREADS")  # else as given
    real_gpus = worker["gpu_backend"] in (None, "auto", "nvml", "nvml-readonly")
    devices = worker_devices(sizes) if real_gpus else [None] * len(names)
    scheduler = {k: getattr(args, k) for k in SCHEDULER_KNOBS}
    specs = [ChildSpec("scheduler", "scheduler", [*cli, "scheduler"], env_of({**model, **scheduler}))]
    for name, device, size in zip(names, devices, sizes, strict=True):
        role: Role = "attention-worker" if name.startswith("attn") else "ffn-worker"
        own = attention if role == "attention-worker" else ffn
        if split_cores:  # a group's ranks share their worker's cores
            threads = torch_threads(role, args.attention_workers, args.ffn_workers)
            own = {**own, "torch_threads": max(1, threads // size)}
        env = env_of({**model, **worker, **own, "worker_id": name}) | device_env(device)
        specs.append(ChildSpec(name, role, [*cli, role], env))
    gateway = {k: getattr(args, k) for k in GATEWAY_KNOBS}
    for i in range(args.gateways):
        specs.append(ChildSpec("gateway" if i == 0 else f"gateway-{i}", "gateway", [*cli, "gateway"],
                               env_of({**model, **gateway, "host": args.host, "port": args.port + i})))
    return specs


def torch_threads(role: Role, n_attention: int, n_ffn: int, cores: int | None = None) -> int:
    """Each worker's share of this machine's cores when they share it (`aflex up` on one machine).

    The workers of one role split the cores among them, and each role gets them all: at depth 1 the
    halves take turns, so the attention workers compute while the FFN workers wait, and the other
    way round (their idle OpenMP threads sleep through the other half's turn: `shared/openmp_spin.py`).
    Measured on 2 cores, 1 + 1, in one sitting: `benchmarks/serve_bench.sh` 42.9 tok/s for 2 and 2
    threads against 34.9 for attention 1 and FFN 2 (TPOT 210 against 275 ms); a 16-row decode step
    206 against 241 ms.
    """
    cores = cores or os.cpu_count() or 1
    return max(1, cores // max(1, n_ffn if role == "ffn-worker" else n_attention))


def local_host(host: str) -> str:
    """Where to reach a server bound to `host` from this machine."""
    return "127.0.0.1" if host in WILDCARD_HOSTS else host


def http_ready(base_url: str) -> Callable[[], bool]:
    def probe() -> bool:
        try:
            with urllib.request.urlopen(f"{base_url}/ready", timeout=2.0) as response:
                return int(response.status) == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    return probe


def served_model_id(base_url: str, fallback: str) -> str:
    """The id clients should send, from the gateway's `/v1/models`; `fallback` if it cannot say."""
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=5.0) as response:
            data = json.loads(response.read())
        return str(data["data"][0]["id"])
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError):
        return fallback


def up(args: argparse.Namespace, *, command_builder: CommandBuilder = build_commands,
       on_child_death: Iterable[ChildDeathHook] = ()) -> int:
    """Run the mesh until SIGINT/SIGTERM (exit 0) or until the gateway or the scheduler dies (exit 1)."""
    from services.launcher.embedded_nats import UpNats

    args = resolve_layout(args)  # the workers decided once: the commands and the serving line say the same
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    env = dict(os.environ)
    nats = UpNats(env, args.nats_port, args.nats_cluster)
    supervisor: Supervisor | None = None
    try:
        nats.start()
        env["AFLEX_NATS_URL"] = nats.url
        specs = nats.for_children(command_builder(args))
        supervisor = Supervisor(specs, env, grace_s=args.grace,
                                on_child_death=[reset_clock_hook(specs), *on_child_death])
        supervisor.start()
        base_url = f"http://{local_host(args.host)}:{args.port}"
        try:
            supervisor.wait_ready(_unless(stop, http_ready(base_url)), timeout_s=args.ready_timeout)
        except SupervisorError as exc:
            supervisor.report(str(exc))
            return 1
        if stop.is_set():
            return 0
        model_id = served_model_id(base_url, fallback=str(args.model))
        workers = workers_text(args)
        print(f"{SERVING_ANNOUNCEMENT} {model_id} at http://{args.host}:{args.port}/v1 ({workers})", flush=True)
        return supervisor.serve(stop)
    finally:
        if supervisor is not None:
            supervisor.stop()
        nats.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _unless(stop: threading.Event, probe: Callable[[], bool]) -> Callable[[], bool]:
    """A readiness probe that also ends the wait when the user asks to stop."""
    return lambda: stop.is_set() or probe()

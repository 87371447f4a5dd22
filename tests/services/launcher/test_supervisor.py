"""`aflex up`'s child management, with small stand-in scripts instead of the real services.

The stand-ins keep the real names, roles and start order (`build_commands`), so what is tested
is the supervisor: ordering, output prefixes, crashes restarted with backoff until a crash loop, SIGTERM
shutdown of every child and of the nats-server, and a readiness wait that names a dead child.
The end-to-end test against the real services lives elsewhere.
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest

from services.launcher import layout
from services.launcher import supervisor as sup
from services.launcher.cli import build_parser, main
from shared.settings import (
    AttentionWorkerSettings,
    FFNWorkerSettings,
    GatewaySettings,
    SchedulerSettings,
    WorkerSettings,
)
from shared.settings_flags import from_flags
from shared.transport.nats_server import free_port
from tests.conftest import REPO_ROOT

ROOT = REPO_ROOT

# A stand-in service: records start/stop in $DUMMY_LOG, writes one line to stdout and one to stderr,
# then behaves per its mode: `serve` (sleep until SIGTERM), `crash CODE`, `stubborn` (ignores
# SIGTERM), `gateway PORT` (answers /ready and /v1/models), `late-crash SECONDS CODE`.
DUMMY_SERVICE = textwrap.dedent('''\
    import http.server, json, os, signal, sys, threading, time
    name, mode, *rest = sys.argv[1:]
    def record(event):
        with open(os.environ["DUMMY_LOG"], "a") as log:
            log.write(f"{name} {event}\\n")
    def nats_state():
        import socket, urllib.parse
        url = urllib.parse.urlparse(os.environ.get("AFLEX_NATS_URL", ""))
        try:
            with socket.create_connection((url.hostname, url.port), timeout=1):
                return "up"
        except (OSError, TypeError):
            return "down"
    def on_term(*_):
        record(f"saw-nats-{nats_state()}")
        record("stopped")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    record(f"started {os.getpid()} {os.environ.get('AFLEX_NATS_URL')}")
    print(f"hello from {name}", flush=True)
    print(f"warning from {name}", file=sys.stderr, flush=True)
    if mode == "crash":
        sys.exit(int(rest[0]))
    if mode == "late-crash":
        time.sleep(float(rest[0]))
        sys.exit(int(rest[1]))
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "gateway":
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                known = {"/ready": b"{}", "/v1/models": json.dumps({"data": [{"id": "dummy-model"}]}).encode()}
                body = known.get(self.path, b"{}")
                self.send_response(200 if self.path in known else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            def log_message(self, *args):
                pass
        server = http.server.HTTPServer(("127.0.0.1", int(rest[0])), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    while True:
        time.sleep(0.05)
''')


@pytest.fixture
def dummy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = tmp_path / "dummy_service.py"
    script.write_text(DUMMY_SERVICE)
    monkeypatch.setenv("DUMMY_LOG", str(tmp_path / "events.log"))
    return script


def events(tmp_path: Path) -> list[str]:
    path = tmp_path / "events.log"
    return path.read_text().splitlines() if path.exists() else []


def up_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


def dummy_builder(script: Path, modes: dict[str, list[str]]) -> sup.CommandBuilder:
    """The real specs (names, roles, order) with each argv replaced by the stand-in."""
    def build(args: argparse.Namespace) -> list[sup.ChildSpec]:
        return [sup.ChildSpec(spec.name, spec.role,
                              [sys.executable, str(script), spec.name, *modes.get(spec.name, ["serve"])])
                for spec in sup.build_commands(args)]
    return build


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


# -- the commands the real services get -----------------------------------------------------
def test_build_commands_order_names_and_settings_in_the_environment() -> None:
    args = up_args("--model", "/models/m.gguf", "--host", "0.0.0.0", "--port", "8123", "--attention-workers", "2",
                   "--ffn-workers", "3", "--dtype", "bfloat16", "--microbatch-depth", "2", "--batching", "fcfs",
                   "--gpu-pace")
    specs = sup.build_commands(args)
    assert [s.name for s in specs] == ["scheduler", "attn-0", "attn-1", "ffn-0", "ffn-1", "ffn-2", "gateway"]
    parser = build_parser()
    for spec in specs:  # the argv names only the service; its settings travel as AFLEX_* variables
        assert spec.argv == [sys.executable, "-m", "services.launcher.cli", spec.role]
        assert parser.parse_args(spec.argv[3:]).command == spec.role
    classes = {"scheduler": SchedulerSettings, "attention-worker": AttentionWorkerSettings,
               "ffn-worker": FFNWorkerSettings, "gateway": GatewaySettings}
    settings = {}
    for spec in specs:  # as the child builds them (_run_service): from its argv's flags and its environment
        child_env = {**{k: v for k, v in os.environ.items() if not k.startswith("AFLEX_")}, **spec.env}
        with mock.patch.dict(os.environ, child_env, clear=True):
            settings[spec.name] = from_flags(classes[spec.role], parser.parse_args(spec.argv[3:]))
    assert all(st.model == "/models/m.gguf" for st in settings.values())
    sched = settings["scheduler"]
    assert isinstance(sched, SchedulerSettings) and (sched.microbatch_depth, sched.batching) == ("2", "fcfs")
    for name in ("attn-1", "ffn-2"):
        worker = settings[name]
        assert isinstance(worker, WorkerSettings)
        assert (worker.worker_id, worker.dtype, worker.gpu_pace) == (name, "bfloat16", True)
        assert worker.torch_threads is not None and worker.torch_threads >= 1  # the cores split among them
    gateway = settings["gateway"]
    assert isinstance(gateway, GatewaySettings) and (gateway.host, gateway.port) == ("0.0.0.0", 8123)


def test_the_cores_are_split_among_the_workers_of_each_role() -> None:
    assert [sup.torch_threads(role, 1, 1, 2) for role in ("attention-worker", "ffn-worker")] == [2, 2]
    assert [sup.torch_threads(role, 2, 2, 2) for role in ("attention-worker", "ffn-worker")] == [1, 1]
    assert [sup.torch_threads(role, 1, 1, 16) for role in ("attention-worker", "ffn-worker")] == [16, 16]
    assert [sup.torch_threads(role, 3, 1, 16) for role in ("attention-worker", "ffn-worker")] == [5, 16]


def test_torch_threads_given_by_flag_or_environment_are_not_split() -> None:
    def threads(specs: list[sup.ChildSpec]) -> dict[str, str | None]:
        return {s.name: s.env.get("AFLEX_TORCH_THREADS") for s in specs if s.role.endswith("worker")}

    split = ("--ffn-workers", "1")
    with mock.patch.dict(os.environ, {"AFLEX_TORCH_THREADS": "3"}):
        assert threads(sup.build_commands(up_args(*split))) == {"attn-0": None, "ffn-0": None}  # the env reaches them
    assert threads(sup.build_commands(up_args(*split, "--torch-threads", "3"))) == {"attn-0": "3", "ffn-0": "3"}
    with mock.patch.dict(os.environ), mock.patch.object(os, "cpu_count", return_value=2):
        os.environ.pop("AFLEX_TORCH_THREADS", None)
        assert threads(sup.build_commands(up_args(*split))) == {"attn-0": "2", "ffn-0": "2"}


@pytest.mark.parametrize(("argv", "env", "whole"), [
    ((), {}, True),  # the defaults, workers on this host's CPU: the whole model in one worker
    (("--attention-workers", "2"), {}, True),  # two whole-model replicas
    (("--ffn-workers", "1"), {}, False),
    (("--provision-kinds", "pd"), {}, False),
    ((), {"AFLEX_PROVISION_KINDS": "mixed"}, False),
    (("--device", "cuda:0"), {}, False),
    ((), {"AFLEX_DEVICE": "cuda"}, False),
])
def test_on_a_cpu_host_the_default_is_the_whole_model_in_one_worker(argv: tuple[str, ...], env: dict[str, str],
                                                                     whole: bool) -> None:
    clean = {k: v for k, v in os.environ.items() if k not in ("AFLEX_PROVISION_KINDS", "AFLEX_DEVICE")}
    with mock.patch.dict(os.environ, {**clean, **env}, clear=True):
        specs = sup.build_commands(up_args(*argv))
        assert layout.whole_model_here(up_args(*argv)) == whole
    workers = [s for s in specs if s.role.endswith("worker")]
    scheduler = next(s for s in specs if s.role == "scheduler")  # it makes such a worker colocated on sight
    assert (scheduler.env.get("AFLEX_PROVISION_KINDS") == "colocated") == whole
    if whole:
        assert all(s.role == "attention-worker" and s.env["AFLEX_COLOCATE"] == "true" for s in workers)
    else:
        assert [s.role for s in workers].count("ffn-worker") == 1
        assert all(s.env.get("AFLEX_COLOCATE") != "true" for s in workers)


def test_build_commands_leaves_unset_options_to_the_services() -> None:
    specs = sup.build_commands(up_args())
    for spec in specs:
        assert "AFLEX_DTYPE" not in spec.env and "AFLEX_MICROBATCH_DEPTH" not in spec.env
        assert "AFLEX_NATS_URL" not in spec.env  # set once, by `up`, for every child


def test_up_hands_the_api_keys_to_the_gateway_alone() -> None:
    specs = {spec.name: spec for spec in sup.build_commands(up_args("--api-key", "k1,k2"))}
    assert specs["gateway"].env["AFLEX_API_KEY"] == "k1,k2"
    assert GatewaySettings(api_key=specs["gateway"].env["AFLEX_API_KEY"]).api_keys == ("k1", "k2")
    assert all("AFLEX_API_KEY" not in spec.env for name, spec in specs.items() if name != "gateway")
    assert "AFLEX_API_KEY" not in sup.build_commands(up_args())[-1].env


def test_service_flags_come_from_the_settings_fields() -> None:
    """Every settings field is a flag of its subcommand, and a flag's value reaches the settings."""
    from services.launcher.cli import SERVICES
    from shared import settings as shared_settings
    from shared.settings_flags import flag_name, from_flags

    parser = build_parser()
    for command, (cls_name, _) in SERVICES.items():
        cls = getattr(shared_settings, cls_name)
        helps = parser._subparsers._group_actions[0].choices[command].format_help()  # type: ignore[union-attr]
        for field in cls.model_fields:
            assert flag_name(field) in helps and f"AFLEX_{field.upper()}" in helps, (command, field)
    args = parser.parse_args(["scheduler", "--max-batch-tokens", "512", "--batching", "fcfs", "--no-freq-observe"])
    got = from_flags(SchedulerSettings, args)
    assert (got.max_batch_tokens, got.batching, got.freq_observe) == (512, "fcfs", False)
    args = parser.parse_args(["ffn-worker", "--no-merge", "--gpu-control", "emulated"])
    ffn = from_flags(FFNWorkerSettings, args)
    assert ffn.merge_microbatches is False and ffn.gpu_backend == "emulated"


def test_a_bad_environment_value_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    with mock.patch.dict(os.environ, {"AFLEX_MAX_BATCH_TOKENS": "lots"}):
        assert main(["scheduler"]) == 2
    err = capsys.readouterr().err
    assert "max_batch_tokens" in err and "Traceback" not in err


def test_up_rejects_zero_workers() -> None:
    with pytest.raises(SystemExit):
        up_args("--attention-workers", "0")


# -- the Supervisor class -------------------------------------------------------------------
def out(supervisor: sup.Supervisor) -> str:
    assert isinstance(supervisor.stdout, io.StringIO)
    return supervisor.stdout.getvalue()


def err(supervisor: sup.Supervisor) -> str:
    assert isinstance(supervisor.stderr, io.StringIO)
    return supervisor.stderr.getvalue()


def make_supervisor(script: Path, modes: dict[str, list[str]], **kwargs: object) -> sup.Supervisor:
    specs = dummy_builder(script, modes)(up_args("--ffn-workers", "1"))
    return sup.Supervisor(specs, dict(os.environ, AFLEX_NATS_URL="nats://example:4222"),
                          stdout=io.StringIO(), stderr=io.StringIO(), **kwargs)  # type: ignore[arg-type]


def test_children_start_in_order_and_their_output_is_prefixed(dummy: Path, tmp_path: Path) -> None:
    supervisor = make_supervisor(dummy, {})
    supervisor.start()
    try:
        assert [c.name for c in supervisor.children] == ["scheduler", "attn-0", "ffn-0", "gateway"]
        wait_until(lambda: len(events(tmp_path)) == 4)
        assert all(line.endswith("nats://example:4222") for line in events(tmp_path))
        assert all(c.process.poll() is None for c in supervisor.children)
    finally:
        supervisor.stop()
    stdout, stderr = out(supervisor), err(supervisor)
    for name in ("scheduler", "attn-0", "ffn-0", "gateway"):
        assert f"[{name}] hello from {name}\n" in stdout
        assert f"[{name}] warning from {name}\n" in stderr
        assert f"warning from {name}" not in stdout
    # stopped in order: gateway, scheduler, then the workers
    assert [e.split()[0] for e in events(tmp_path) if e.endswith("stopped")] == [
        "gateway", "scheduler", "attn-0", "ffn-0"]
    assert "exited with status" not in stderr  # a requested stop is not a death


FAST = sup.RestartPolicy(backoff_first_s=0.05, backoff_max_s=0.2, max_fast_crashes=2)


def test_a_crashing_worker_is_restarted_with_backoff_then_given_up_on(dummy: Path, tmp_path: Path) -> None:
    deaths: list[sup.ChildExit] = []
    supervisor = make_supervisor(dummy, {"attn-0": ["late-crash", "0.3", "3"]}, on_child_death=[deaths.append],
                                 restart=FAST)
    supervisor.start()
    others = {c.name: c.process.pid for c in supervisor.children if c.name != "attn-0"}
    stop = threading.Event()
    try:
        threading.Timer(3.0, stop.set).start()
        assert supervisor.serve(stop, interval_s=0.05) == 0  # a worker given up on does not stop the mesh
        assert {c.name: c.process.pid for c in supervisor.children if c.name != "attn-0"} == others
        running = {c.name: c.process.poll() is None for c in supervisor.children}
        assert running == {"scheduler": True, "attn-0": False, "ffn-0": True, "gateway": True}
    finally:
        supervisor.stop()
    stderr = err(supervisor)
    assert stderr.count("aflex up: attn-0 exited with status 3\n") == 3  # the first run and two restarts
    assert "restarting attn-0 in 0.05 s" in stderr and "restarting attn-0 in 0.1 s" in stderr
    assert "attn-0 crashed 3 times in a row" in stderr and "not restarting it" in stderr
    assert [e.split()[0] for e in events(tmp_path) if "started" in e].count("attn-0") == 3
    assert [(d.name, d.role, d.returncode, d.killed) for d in deaths] == [("attn-0", "attention-worker", 3, False)] * 3


def test_a_killed_scheduler_is_started_again_and_the_mesh_serves_on(dummy: Path, tmp_path: Path) -> None:
    supervisor = make_supervisor(dummy, {}, restart=FAST)
    supervisor.start()
    stop = threading.Event()
    try:
        first = supervisor.children[0]
        assert first.name == "scheduler"
        wait_until(lambda: any(e.startswith("scheduler started") for e in events(tmp_path)))
        os.kill(first.process.pid, signal.SIGKILL)
        server = threading.Thread(target=lambda: supervisor.serve(stop, interval_s=0.05))
        server.start()
        wait_until(lambda: [e.split()[0] for e in events(tmp_path) if "started" in e].count("scheduler") == 2)
        stop.set()
        server.join(10)
        assert supervisor.children[0] is not first and supervisor.children[0].process.poll() is None
        assert all(c.process.poll() is None for c in supervisor.children)
    finally:
        supervisor.stop()
    assert "aflex up: scheduler exited with status -9 (SIGKILL)\n" in err(supervisor)
    assert "restarting scheduler in 0.05 s" in err(supervisor)


def test_a_scheduler_in_a_crash_loop_stops_serving_with_status_1(dummy: Path) -> None:
    supervisor = make_supervisor(dummy, {"scheduler": ["late-crash", "0.3", "1"]}, restart=FAST)
    supervisor.start()
    try:
        assert supervisor.serve(threading.Event(), interval_s=0.05) == 1
    finally:
        supervisor.stop()
    stderr = err(supervisor)
    assert stderr.count("aflex up: scheduler exited with status 1\n") == 3
    assert "scheduler is needed to serve" in stderr
    assert all(c.process.poll() is not None for c in supervisor.children)


def test_without_a_restart_policy_a_dead_worker_stays_dead(dummy: Path) -> None:
    supervisor = make_supervisor(dummy, {"attn-0": ["late-crash", "0.3", "3"]}, restart=None)
    supervisor.start()
    stop = threading.Event()
    threading.Timer(1.5, stop.set).start()
    try:
        assert supervisor.serve(stop, interval_s=0.05) == 0
    finally:
        supervisor.stop()
    assert err(supervisor).count("aflex up: attn-0 exited with status 3\n") == 1
    assert "restarting" not in err(supervisor)


def test_child_ignoring_sigterm_is_killed_after_the_grace_period(dummy: Path) -> None:
    deaths: list[sup.ChildExit] = []
    supervisor = make_supervisor(dummy, {"ffn-0": ["stubborn"]}, grace_s=0.5, on_child_death=[deaths.append])
    supervisor.start()
    wait_until(lambda: "[ffn-0] hello" in out(supervisor))
    started = time.monotonic()
    supervisor.stop()
    assert time.monotonic() - started < 5
    assert [(d.name, d.returncode, d.killed) for d in deaths] == [("ffn-0", -signal.SIGKILL, True)]
    assert "ffn-0 did not stop within" in err(supervisor)


def test_failing_hook_does_not_break_the_others(dummy: Path) -> None:
    seen: list[str] = []

    def broken(_: sup.ChildExit) -> None:
        raise RuntimeError("boom")

    supervisor = make_supervisor(dummy, {"attn-0": ["crash", "2"]},
                                 on_child_death=[broken, lambda e: seen.append(e.name)])
    supervisor.start()
    try:
        wait_until(lambda: bool(supervisor.poll()))
    finally:
        supervisor.stop()
    assert seen == ["attn-0"]
    assert "hook 'broken' failed for attn-0: boom" in err(supervisor)


def test_readiness_timeout(dummy: Path) -> None:
    supervisor = make_supervisor(dummy, {})
    supervisor.start()
    try:
        with pytest.raises(sup.ReadinessTimeoutError):
            supervisor.wait_ready(lambda: False, timeout_s=0.3, interval_s=0.05)
    finally:
        supervisor.stop()


# -- up() -----------------------------------------------------------------------------------
def test_up_names_the_child_that_died_before_ready(dummy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("AFLEX_NATS_URL", "nats://127.0.0.1:1")  # no embedded nats-server for this one
    port = free_port()
    builder = dummy_builder(dummy, {"attn-0": ["crash", "1"]})  # the gateway never comes up either
    started = time.monotonic()
    status = sup.up(up_args("--port", str(port), "--ready-timeout", "20", "--grace", "2"), command_builder=builder)
    assert status == 1
    assert time.monotonic() - started < 10  # the death ends the wait, not the timeout
    err = capsys.readouterr().err
    assert "aflex up: attn-0 exited with status 1 before AFlex was ready" in err
    assert "using NATS at nats://127.0.0.1:1" in err
    lines = events(tmp_path)
    # every child that got as far as starting was stopped (under load the gateway may not have started yet)
    started_names = {line.split()[0] for line in lines if " started " in line} - {"attn-0"}
    assert started_names >= {"scheduler"}
    assert {line.split()[0] for line in lines if line.endswith("stopped")} == started_names


UP_SCRIPT = textwrap.dedent('''\
    import sys
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {tests!r})
    from services.launcher import supervisor as sup
    from services.launcher.cli import build_parser
    from test_supervisor import dummy_builder
    args = build_parser().parse_args(sys.argv[2:])
    raise SystemExit(sup.up(args, command_builder=dummy_builder(__import__("pathlib").Path(sys.argv[1]),
                                                               {{"gateway": ["gateway", str(args.port)]}})))
''')


def test_up_serves_then_sigterm_stops_every_child_and_the_nats_server(dummy: Path, tmp_path: Path) -> None:
    script = tmp_path / "run_up.py"
    script.write_text(UP_SCRIPT.format(root=str(ROOT), tests=str(Path(__file__).parent)))
    port, nats_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "AFLEX_NATS_URL"}
    process = subprocess.Popen(
        [sys.executable, str(script), str(dummy), "up", "--port", str(port), "--nats-port", str(nats_port),
         "--attention-workers", "2", "--ffn-workers", "2", "--ready-timeout", "20"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        lines: list[str] = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("AFlex is serving"):
                break
        assert lines and lines[-1] == (f"AFlex is serving dummy-model at http://127.0.0.1:{port}/v1 "
                                       "(2 attention + 2 FFN workers)\n"), "".join(lines)
        assert listening(nats_port)
        started = [line.split() for line in events(tmp_path) if " started " in line]
        # (the start order is checked on the Supervisor; processes log their start concurrently)
        assert sorted(s[0] for s in started) == ["attn-0", "attn-1", "ffn-0", "ffn-1", "gateway", "scheduler"]
        assert {s[3] for s in started} == {f"nats://127.0.0.1:{nats_port}"}
        pids = [int(s[2]) for s in started]
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    assert "[gateway] hello from gateway" in "".join(lines) + out
    assert "exited with status" not in err
    assert not any(alive(pid) for pid in pids)
    assert [e.split()[0] for e in events(tmp_path) if e.endswith("stopped")] == [
        "gateway", "scheduler", "attn-0", "attn-1", "ffn-0", "ffn-1"]
    assert not listening(nats_port)


def test_ctrl_c_stops_the_services_before_the_nats_server(dummy: Path, tmp_path: Path) -> None:
    """Ctrl-C signals the whole foreground process group; only the supervisor may act on it."""
    script = tmp_path / "run_up.py"
    script.write_text(UP_SCRIPT.format(root=str(ROOT), tests=str(Path(__file__).parent)))
    port, nats_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "AFLEX_NATS_URL"}
    process = subprocess.Popen([sys.executable, str(script), str(dummy), "up", "--port", str(port), "--nats-port",
                                str(nats_port), "--ready-timeout", "20"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0)
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("AFlex is serving"):
                break
        os.killpg(process.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        _, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    saw = [e for e in events(tmp_path) if " saw-nats-" in e]
    assert saw and all(e.endswith("saw-nats-up") for e in saw), saw
    assert not listening(nats_port)

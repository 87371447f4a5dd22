"""The compose stack for real: built from the repository, it serves, survives a crash, drains, goes away.

`scripts/compose_check.sh` gets Docker ready and builds the image, then runs this against it:

1. `docker compose up -d` (a project of its own, free ports), then wait for the gateway's `/ready`;
2. with the official `openai` client: a greedy chat equals `aflex generate`'s answer (run in the image),
   and so does the same chat streamed; the read-only `telemetry` user receives worker and scheduler
   telemetry on the published NATS port;
3. a crash: the attention worker's process is SIGKILLed mid-stream (`docker kill` would be a manual stop,
   which Docker never restarts); the restart policy brings it back and the stream ends with exactly the
   no-fault text;
4. the only FFN worker `docker kill`ed mid-stream (gone for good: Docker restarts no container it was told
   to kill): the stream ends within the scheduler's `unserved_bound_s` with the typed `no_workers_ready`
   error, `/ready` says 503 meanwhile; `docker compose start` brings it back;
5. `docker compose stop` mid-stream: the gateway drains, the stream ends whole, every AFlex service exits 0;
6. `docker compose down -v`: no container, network or volume of the project is left.

It prints a line per step with its time and exits 1 at the first failure, saying what failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import openai

from shared.settings import SchedulerSettings
from shared.transport.nats_server import free_port

REPO = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO / "compose" / "compose.yaml"
AFLEX_SERVICES = ("gateway", "scheduler", "attention-worker", "ffn-worker")
CHAT_PROMPT = "Name three colours."
STORY_PROMPT = "Once upon a time"
STORY_TOKENS = 160  # long enough to be mid-stream when the fault lands (ignore_eos: always this many)
UNSERVED_BOUND_S = SchedulerSettings.model_fields["unserved_bound_s"].default  # a half gone: requests end by then


class CheckFailed(Exception):
    """A step of the check did not hold."""


def run(*argv: str, env: dict[str, str] | None = None, timeout_s: float = 900.0) -> str:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise CheckFailed(f"`{' '.join(argv)}` exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


class Stack:
    """One compose project on free ports; every docker command of the check goes through it."""

    def __init__(self, image: str) -> None:
        self.project = f"aflex-check-{secrets.token_hex(3)}"
        self.port, self.nats_port = free_port(), free_port()
        self.telemetry_password = secrets.token_hex(8)
        self.image = image
        self.env = {**os.environ, "AFLEX_IMAGE": image, "AFLEX_PORT": str(self.port),
                    "AFLEX_NATS_PORT": str(self.nats_port),
                    "AFLEX_NATS_PASSWORD_TELEMETRY": self.telemetry_password}

    def compose(self, *args: str, timeout_s: float = 900.0) -> str:
        return run("docker", "compose", "-p", self.project, "-f", str(COMPOSE_FILE), *args, env=self.env,
                   timeout_s=timeout_s)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def container(self, service: str) -> str:
        return self.compose("ps", "-a", "-q", service).strip()

    def states(self) -> dict[str, dict[str, object]]:
        """service -> its container's State (Status, ExitCode, ...), every container of the project."""
        ids = self.compose("ps", "-a", "-q").split()
        inspected = json.loads(run("docker", "inspect", *ids)) if ids else []
        return {c["Config"]["Labels"]["com.docker.compose.service"]: {**c["State"], "RestartCount": c["RestartCount"]}
                for c in inspected}

    def leftovers(self) -> list[str]:
        label = f"label=com.docker.compose.project={self.project}"
        kinds = (("container", ("ps", "-a", "-q")), ("network", ("network", "ls", "-q")),
                 ("volume", ("volume", "ls", "-q")))
        return [f"{kind} {name}" for kind, cmd in kinds for name in run("docker", *cmd, "--filter", label).split()]


def step(name: str) -> Callable[[Callable[[], str | None]], None]:
    """Run the decorated step now, printing its name, time and what it says."""
    def decorate(fn: Callable[[], str | None]) -> None:
        start = time.monotonic()
        said = fn()
        print(f"compose_check: {name}: ok ({time.monotonic() - start:.1f} s){': ' + said if said else ''}", flush=True)
    return decorate


def wait_ready(stack: Stack, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{stack.port}/ready", timeout=3) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise CheckFailed(f"/ready not 200 within {timeout_s:.0f} s:\n{stack.compose('logs', '--tail', '40')}")


def generate(image: str, *args: str) -> str:
    """`aflex generate` in the image: the in-process engine's answer, the one the split mesh must give."""
    out = run("docker", "run", "--rm", image, "generate", "--json", *args)
    text: str = json.loads(out.strip().splitlines()[-1])["text"]
    return text


def story_stream(stack: Stack, model: str, fault: Callable[[], object]) -> str:
    """A greedy streamed completion; `fault` runs (in a thread) once a few tokens have arrived."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=600)
    stream = client.completions.create(model=model, prompt=STORY_PROMPT, max_tokens=STORY_TOKENS, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    text, chunks, faulted, finish = "", 0, None, None
    for chunk in stream:
        text += chunk.choices[0].text if chunk.choices else ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
        chunks += 1
        if chunks == 5 and faulted is None:
            faulted = threading.Thread(target=fault)
            faulted.start()
    if faulted is None:
        raise CheckFailed(f"the stream ended after {chunks} chunks, before the fault")
    if finish != "length":
        raise CheckFailed(f"the stream ended with finish_reason {finish!r}, not 'length'")
    faulted.join()
    return text


async def telemetry_roles(url: str, wanted: set[str], timeout_s: float) -> set[str]:
    from shared.transport import bus

    nc = await bus.connect(url, "compose-check-telemetry")
    seen: set[str] = set()
    got_all = asyncio.Event()

    async def on_msg(msg: object) -> None:
        seen.add(str(getattr(msg, "subject", "")).split(".")[3])  # aflex.v1.telemetry.<role>.<id>
        if wanted <= seen:
            got_all.set()

    try:
        await nc.subscribe("aflex.v1.telemetry.>", cb=on_msg)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(got_all.wait(), timeout_s)
    finally:
        await bus.close(nc)
    return seen


def check(image: str, ready_timeout_s: float) -> None:
    stack = Stack(image)
    print(f"compose_check: project {stack.project}, gateway :{stack.port}, NATS :{stack.nats_port}", flush=True)
    try:
        @step("up, /ready")
        def _() -> str:
            stack.compose("up", "-d", "--no-build")
            wait_ready(stack, ready_timeout_s)
            return f"http://127.0.0.1:{stack.port}/ready is 200"

        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        reference = generate(image, "--chat", "--prompt", CHAT_PROMPT, "--max-tokens", "24")
        story = generate(image, "--prompt", STORY_PROMPT, "--max-tokens", str(STORY_TOKENS), "--ignore-eos")

        @step("greedy chat equals `aflex generate`, plain and streamed")
        def _() -> str:
            messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": CHAT_PROMPT}]
            answer = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
            if answer.choices[0].message.content != reference:
                raise CheckFailed(f"chat answered {answer.choices[0].message.content!r}, aflex generate {reference!r}")
            streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=model, messages=messages, max_tokens=24, temperature=0, stream=True) if c.choices)
            if streamed != reference:
                raise CheckFailed(f"the stream said {streamed!r}, aflex generate {reference!r}")
            return repr(reference)

        @step("read-only telemetry")
        def _() -> str:
            url = f"nats://telemetry:{stack.telemetry_password}@127.0.0.1:{stack.nats_port}"
            seen = asyncio.run(telemetry_roles(url, {"attention", "ffn", "scheduler"}, 20.0))
            if not {"attention", "ffn", "scheduler"} <= seen:
                raise CheckFailed(f"telemetry heard from {sorted(seen)} only")
            return f"from {sorted(seen)}"

        @step("attention worker crashes mid-stream")
        def _() -> str:
            before = int(str(stack.states()["attention-worker"]["RestartCount"]))
            pid = run("docker", "inspect", "-f", "{{.State.Pid}}", stack.container("attention-worker")).strip()
            text = story_stream(stack, model, lambda: run("kill", "-9", pid))
            restarts = int(str(stack.states()["attention-worker"]["RestartCount"]))
            if restarts <= before:
                raise CheckFailed("the attention worker was not restarted")
            if text != story:
                raise CheckFailed(f"the stream after the crash differs from the no-fault text:\n{text!r}\n{story!r}")
            return f"restarted ({restarts}), the stream exact ({STORY_TOKENS} tokens)"

        @step("the only FFN worker gone for good mid-stream")
        def _() -> str:
            killed: list[float] = []

            def kill() -> None:  # `docker kill`: a manual stop, which Docker never restarts
                run("docker", "kill", stack.container("ffn-worker"))
                killed.append(time.monotonic())

            try:
                story_stream(stack, model, kill)
                raise CheckFailed("the stream ended whole with no FFN worker and no whole-model worker")
            except openai.APIError as exc:
                ended_s = time.monotonic() - killed[0]
                error = str(exc)
            if ended_s > UNSERVED_BOUND_S + 15.0:
                raise CheckFailed(f"the stream ended {ended_s:.1f} s after the kill (bound {UNSERVED_BOUND_S:g} s)")
            if "unserved_bound_s" not in error:
                raise CheckFailed(f"the stream ended with {error!r}, not the typed no_workers_ready error")
            ready = f"http://127.0.0.1:{stack.port}/ready"
            with contextlib.suppress(OSError), urllib.request.urlopen(ready, timeout=3):  # a 503 raises HTTPError
                raise CheckFailed("/ready said 200 with no FFN worker")
            stack.compose("start", "ffn-worker")
            wait_ready(stack, ready_timeout_s)
            return f"ended {ended_s:.1f} s after the kill with {error[:80]!r}; /ready 503 meanwhile; started again"

        @step("`docker compose stop` drains mid-stream")
        def _() -> str:
            stopped: list[float] = []

            def stop() -> None:
                start = time.monotonic()
                stack.compose("stop")
                stopped.append(time.monotonic() - start)

            text = story_stream(stack, model, stop)
            if text != story:
                raise CheckFailed(f"the stream cut by stop differs from the no-fault text:\n{text!r}\n{story!r}")
            states = stack.states()
            bad = {s: states[s]["ExitCode"] for s in AFLEX_SERVICES if states[s]["ExitCode"] != 0}
            if bad:
                raise CheckFailed(f"exit codes after stop: {bad}\n{stack.compose('logs', '--tail', '30')}")
            if "drained" not in stack.compose("logs", "gateway"):
                raise CheckFailed("the gateway did not say it drained")
            return f"stream whole, every service exited 0, stop took {stopped[0]:.1f} s"

        @step("down -v")
        def _() -> str:
            stack.compose("down", "-v", "--remove-orphans")
            left = stack.leftovers()
            if left:
                raise CheckFailed(f"left behind: {left}")
            return "nothing left"
    except BaseException:
        subprocess.run(["docker", "compose", "-p", stack.project, "-f", str(COMPOSE_FILE), "down", "-v",
                        "--remove-orphans"], env=stack.env, capture_output=True, timeout=600)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--image", default=os.environ.get("AFLEX_IMAGE", "aflex:cpu"))
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for /ready")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        check(args.image, args.ready_timeout)
    except CheckFailed as exc:
        print(f"compose_check: FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"compose_check: passed in {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What both worker kinds share: model loading, stop signals, registration and heartbeats.

A worker is useless until the scheduler knows it, so it registers (request/reply on
`control.register`) right after it subscribes to its microbatch subject, retrying until a scheduler
answers or the registration timeout passes. Heartbeats are sent as requests: NATS answers a request
nobody subscribes to with "no responders" at once, which is how a worker notices that the
scheduler is gone (restarted) and registers again. A scheduler may reply to a heartbeat with a
`RegisterReply(ok=False)` to ask an unknown worker to register again; it need not reply at all.

Each worker also holds one GPU (`WorkerGPU`): the backend from the settings, a DVFS controller fed
by the scheduler's `FrequencyCommand`s on `freq.<wid>`, a meter of its work, and a telemetry task
publishing `WorkerTelemetry` on `telemetry.<role>.<wid>`. The clock is reset when the worker exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg

from shared import subjects
from shared.errors import AFlexError
from shared.gpu.controller import DVFSController
from shared.gpu.telemetry import WorkerMeter, publish_loop
from shared.messages import FrequencyCommand, Heartbeat, ProtocolError, Register, RegisterReply, decode, encode
from shared.transport import bus

if TYPE_CHECKING:
    import torch
    from nats.aio.subscription import Subscription
    from torch import nn

    from shared.gpu.base import GPU
    from shared.model.checkpoint import Checkpoint
    from shared.settings import WorkerSettings

log = logging.getLogger("aflex.worker")

HalfT = TypeVar("HalfT", bound="nn.Module")

REGISTER_ATTEMPT_TIMEOUT_S = 2.0  # one registration request; retried until register_timeout_s
REGISTER_RETRY_WAIT_S = 0.5  # pause after "no responders" (no scheduler subscribed yet)
HEARTBEAT_REPLY_WAIT_S = 0.25  # how long a heartbeat waits for an (optional) scheduler reply


class RegistrationError(AFlexError):
    """No scheduler accepted this worker: none answered in time, or it refused the worker."""


def torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise AFlexError(f"unknown dtype {name!r}")
    return dtype


def load_half(settings: WorkerSettings, half: type[HalfT]) -> tuple[Checkpoint, HalfT]:
    """Open the settings' checkpoint and load only `half`'s tensors (a worker never holds the other half).

    Blocking (reads weights): services call it through `asyncio.to_thread`.
    """
    from shared.model.attention import AttentionHalf
    from shared.model.checkpoint import open_checkpoint
    from shared.model.weights import load_attention_half, load_ffn_half

    checkpoint = open_checkpoint(settings.model)
    load = load_attention_half if issubclass(half, AttentionHalf) else load_ffn_half
    module = load(checkpoint.args, checkpoint.tensors, torch_dtype(settings.dtype), settings.device, settings.quantize)
    if not isinstance(module, half):
        raise TypeError(f"asked to load a {half.__name__}, got a {type(module).__name__}")
    return checkpoint, module


def eos_token_ids(checkpoint: Checkpoint) -> tuple[int, ...]:
    """The tokenizer's EOS ids when the checkpoint ships a tokenizer, else the config's (as Engine does)."""
    tokenizer = checkpoint.tokenizer
    return tuple(tokenizer.eos_token_ids) if tokenizer is not None else tuple(checkpoint.args.eos_token_ids)


async def stop_presence(heartbeat_task: asyncio.Task[None] | None) -> None:
    """Stop heartbeating: the first step of every worker's shutdown (the scheduler then stops sending)."""
    if heartbeat_task is not None:
        heartbeat_task.cancel()
        await asyncio.gather(heartbeat_task, return_exceptions=True)


async def wait_stop(stop: asyncio.Event, timeout_s: float) -> bool:
    """Sleep up to `timeout_s`, waking early when `stop` is set; returns whether it is set."""
    if timeout_s > 0 and not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout_s)
    return stop.is_set()


def registration(worker_id: str, role: Literal["attention", "ffn"], model_id: str, n_layers: int, *,
                 kv_total_blocks: int = 0, block_size: int = 0, max_seq_len: int = 0,
                 gpu: GPU | None = None, seam_address: str = "") -> Register:
    return Register(worker_id=worker_id, role=role, model_id=model_id, n_layers=n_layers,
                    kv_total_blocks=kv_total_blocks, block_size=block_size, max_seq_len=max_seq_len,
                    pid=os.getpid(), started_ts=time.time(),
                    gpu_backend=gpu.backend if gpu is not None else "",
                    gpu_name=gpu.name if gpu is not None else "",
                    gpu_profile=str(getattr(getattr(gpu, "profile", None), "key", "")),
                    supported_clocks_mhz=list(gpu.supported_sm_clocks_mhz()) if gpu is not None else [],
                    seam_address=seam_address)


def clock_phase(phase: str) -> Literal["prefill", "decode"]:
    """The clock phase of a microbatch phase: "decode" stays, "prefill" and "mixed" run prefill clocks."""
    return "decode" if phase == "decode" else "prefill"


def emulated_device_file(settings: WorkerSettings) -> Path | None:
    """Where the worker's emulated GPU keeps its locked clock (`gpu_state_dir`), or None."""
    return Path(settings.gpu_state_dir) / f"{settings.worker_id}.json" if settings.gpu_state_dir else None


class WorkerGPU:
    """A worker's GPU, its DVFS controller, its meter and its telemetry publisher.

    `gpu` may be given (tests pass a fake or an emulated GPU); otherwise `select_gpu` builds it from
    the settings when the worker starts, and `stop` closes it. `stop` always resets the clock.
    """

    def __init__(self, settings: WorkerSettings, worker_id: str, role: Literal["attention", "ffn"],
                 gpu: GPU | None = None) -> None:
        self.settings, self.worker_id, self.role = settings, worker_id, role
        self._owns_gpu = gpu is None
        self.gpu: GPU = gpu if gpu is not None else self._select()
        self.controller = DVFSController(self.gpu, default_clock_mhz=settings.default_clock_mhz,
                                         hysteresis_mhz=settings.hysteresis_mhz, min_hold_s=settings.min_hold_s)
        self.meter = WorkerMeter(worker_id, role)
        self.commands_ignored = 0
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    def _select(self) -> GPU:
        from shared.gpu.select import select_gpu

        s = self.settings
        return select_gpu(s.gpu_backend, s.gpu_profile, s.gpu_pace, device_file=emulated_device_file(s))

    async def start(self, nc: Client) -> None:
        """Reset the clock (a worker before this one may have died with it locked), follow `freq.<wid>`
        commands, and start publishing telemetry."""
        self.controller.reset()
        self.controller.poll()  # the default clock from the start
        self._stop.clear()
        self._sub = await nc.subscribe(subjects.freq(self.worker_id), cb=self._on_command)
        self._task = asyncio.create_task(
            publish_loop(nc, subjects.telemetry(self.role, self.worker_id), self.meter, self.gpu, self.controller,
                         self.settings.telemetry_hz, self._stop), name=f"telemetry-{self.worker_id}")

    async def _on_command(self, msg: Msg) -> None:
        try:
            cmd = decode(FrequencyCommand, msg.data)
        except ProtocolError as exc:
            self.commands_ignored += 1
            log.warning("%s: ignored a malformed frequency command: %s", self.worker_id, exc)
            return
        if cmd.worker_id != self.worker_id:
            self.commands_ignored += 1
            log.warning("%s: ignored a frequency command for worker %s", self.worker_id, cmd.worker_id)
            return
        clocks = self.controller.apply_command(cmd)
        log.debug("%s: frequency command %s until %.3f (%s)", self.worker_id, clocks, cmd.valid_until_ts,
                  cmd.reason)

    async def stop(self) -> None:
        """Stop telemetry and commands, reset the clock, close the GPU if this worker opened it."""
        self._stop.set()
        try:
            if self._task is not None:
                await asyncio.gather(self._task, return_exceptions=True)
                self._task = None
            if self._sub is not None:
                with contextlib.suppress(Exception):  # connection already gone
                    await self._sub.unsubscribe()
                self._sub = None
        finally:
            self.controller.reset()
            if self._owns_gpu:
                with contextlib.suppress(Exception):
                    self.gpu.close()


class Presence:
    """Registration with retry, then a heartbeat every period (re-registering when the scheduler is gone)."""

    def __init__(self, nc: Client, message: Register, heartbeat: Callable[[], Heartbeat], *,
                 period_s: float, register_timeout_s: float, on_new_scheduler: Callable[[], None] | None = None
                 ) -> None:
        self.nc, self.message, self.heartbeat = nc, message, heartbeat
        self.period_s, self.register_timeout_s = period_s, register_timeout_s
        self.on_new_scheduler = on_new_scheduler  # registered with another scheduler run than before
        self.registered = False
        self.scheduler_id: str | None = None
        self.scheduler_instance: str | None = None

    async def _attempt(self, timeout_s: float) -> RegisterReply | None:
        """One registration request: the reply, or None when nobody answered (raises if refused)."""
        try:
            data = await bus.request(self.nc, subjects.CONTROL_REGISTER, encode(self.message), timeout_s)
            reply = decode(RegisterReply, data)
        except (bus.NoRespondersBusError, bus.BusTimeoutError):
            return None
        except ProtocolError as exc:
            log.warning("%s: bad registration reply: %s", self.message.worker_id, exc)
            return None
        except Exception as exc:  # connection lost or closing: transient, retried
            log.warning("%s: registration request failed: %s", self.message.worker_id, exc)
            return None
        if not reply.ok:
            reason = reply.error.message if reply.error else "no reason given"
            raise RegistrationError(f"scheduler {reply.scheduler_id} refused worker "
                                    f"{self.message.worker_id}: {reason}")
        self.registered, self.scheduler_id = True, reply.scheduler_id
        before, self.scheduler_instance = self.scheduler_instance, reply.scheduler_instance
        if before is not None and before != reply.scheduler_instance and self.on_new_scheduler is not None:
            self.on_new_scheduler()  # the new run knows nothing of what the old one placed here
        return reply

    async def register(self, stop: asyncio.Event) -> RegisterReply | None:
        """Retry until a scheduler accepts us; None if `stop` was set first; raises `RegistrationError`."""
        deadline = time.monotonic() + self.register_timeout_s
        while not stop.is_set():
            remaining = deadline - time.monotonic()
            reply = await self._attempt(max(0.05, min(REGISTER_ATTEMPT_TIMEOUT_S, remaining)))
            if reply is not None:
                log.info("%s: registered with scheduler %s", self.message.worker_id, reply.scheduler_id)
                return reply
            if time.monotonic() >= deadline:
                raise RegistrationError(f"worker {self.message.worker_id}: no scheduler answered on "
                                        f"{subjects.CONTROL_REGISTER} within {self.register_timeout_s:.0f} s")
            await wait_stop(stop, min(REGISTER_RETRY_WAIT_S, max(0.0, deadline - time.monotonic())))
        return None

    async def _beat(self) -> bool:
        """Send one heartbeat; False when no scheduler is there (or it asks us to register again)."""
        subject = subjects.heartbeat(self.message.worker_id)
        try:
            data = await bus.request(self.nc, subject, encode(self.heartbeat()),
                                     min(HEARTBEAT_REPLY_WAIT_S, self.period_s / 2))
        except bus.NoRespondersBusError:
            return False
        except bus.BusTimeoutError:  # heard, not answered: the normal case
            return True
        except Exception as exc:  # disconnected: nats-py reconnects; do not re-register for that
            log.debug("%s: heartbeat not sent: %s", self.message.worker_id, exc)
            return True
        try:
            return decode(RegisterReply, data).ok
        except ProtocolError:
            return True

    async def heartbeat_loop(self, stop: asyncio.Event) -> None:
        next_at = time.monotonic()
        while True:
            next_at += self.period_s
            if await wait_stop(stop, next_at - time.monotonic()):
                return
            try:
                if not await self._beat():
                    if self.registered:
                        log.warning("%s: no scheduler heard the heartbeat; registering again",
                                    self.message.worker_id)
                    self.registered = False
                if not self.registered and await self._attempt(min(REGISTER_ATTEMPT_TIMEOUT_S, self.period_s)):
                    log.info("%s: registered again with scheduler %s", self.message.worker_id, self.scheduler_id)
            except RegistrationError as exc:
                log.error("%s", exc)
            except Exception:  # the heartbeat must never die
                log.exception("%s: heartbeat failed", self.message.worker_id)

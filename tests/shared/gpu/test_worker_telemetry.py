"""Worker telemetry, frequency commands and energy on a real nats-server, with emulated GPUs.

Both workers run in-process (tests/test_workers.py's `mesh`), each with its own `EmulatedGPU`
(no pacing, so modelled time does not slow the test). The test plays the scheduler: it sends
microbatches and `FrequencyCommand`s and listens to `telemetry.>`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest
from nats.aio.msg import Msg

from shared import subjects
from shared.gpu.emulated import EmulatedGPU
from shared.messages import (
    FrequencyCommand,
    MicrobatchDescriptor,
    MicrobatchDone,
    Phase,
    SeqWork,
    WorkerTelemetry,
    decode,
    encode,
)
from tests.services.test_workers import GREEDY, Mesh, mesh, run_async

HZ = 10.0
PROMPT = [5, 17, 33, 101, 7, 250, 11, 64, 3]
SCHEMA = WorkerTelemetry.model_json_schema()


class Listener:
    """Every telemetry message, with its arrival time."""

    def __init__(self) -> None:
        self.telemetry: list[tuple[float, WorkerTelemetry]] = []

    async def on_telemetry(self, msg: Msg) -> None:
        raw = orjson.loads(msg.data)
        jsonschema.validate(raw, SCHEMA)
        tel = decode(WorkerTelemetry, msg.data)
        assert msg.subject == subjects.telemetry(tel.role, tel.worker_id)
        self.telemetry.append((time.monotonic(), tel))

    def of(self, worker_id: str, since: float = 0.0) -> list[WorkerTelemetry]:
        return [t for ts, t in self.telemetry if t.worker_id == worker_id and ts >= since]


async def send(m: Mesh, seqs: list[SeqWork], phase: Phase) -> MicrobatchDone:
    m.counter += 1
    desc = MicrobatchDescriptor(mb_id=f"mb{m.counter}", iteration=m.counter, phase=phase,
                                ffn_worker=m.ffn.worker_id, seqs=seqs)
    return await m.send(desc)


def mean_latency_ms(tels: list[WorkerTelemetry], phase: str) -> float:
    total = count = 0.0
    for t in tels:
        if phase in t.latency_ms:
            total += t.latency_ms[phase].mean_ms * t.latency_ms[phase].count
            count += t.latency_ms[phase].count
    assert count > 0, f"no {phase} latency reported"
    return total / count


async def until(predicate: Any, timeout_s: float) -> float:
    """Seconds until `predicate()` holds (fails after `timeout_s`)."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "condition not reached in time"
        await asyncio.sleep(0.005)
    return time.monotonic() - start


def test_telemetry_frequency_and_energy(nats_url: str, tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["llama"]
    gpus = {"attention": EmulatedGPU("a800"), "ffn": EmulatedGPU("a800")}
    energy_start = sum(g.total_energy_j() for g in gpus.values())
    listener = Listener()
    dones: list[MicrobatchDone] = []

    async def body() -> None:
        async with mesh(nats_url, path, worker_settings={"telemetry_hz": HZ, "min_hold_s": 0.05},
                        attention_gpu=gpus["attention"], ffn_gpu=gpus["ffn"]) as m:
            attn_id, ffn_id = m.attention.worker_id, m.ffn.worker_id
            for reg in m.registrations:
                assert reg.gpu_backend == "emulated" and "A800" in reg.gpu_name
                assert reg.supported_clocks_mhz[0] == 210 and reg.supported_clocks_mhz[-1] == 1410
            await m.nc.subscribe(subjects.TELEMETRY_ALL, cb=listener.on_telemetry)
            await m.nc.flush()

            # -- rate and content ------------------------------------------------------------------
            t0 = time.monotonic()
            await asyncio.sleep(1.0)
            for wid in (attn_id, ffn_id):
                n = len(listener.of(wid, t0))
                assert 0.6 * HZ <= n <= 1.4 * HZ, f"{wid}: {n} telemetry messages in 1 s at {HZ} Hz"
            last = listener.of(attn_id)[-1]
            assert last.role == "attention" and last.gpu_backend == "emulated" and last.clock_mhz == 1410
            assert last.target_clock_mhz == 1410 and last.command_applied and last.kv_blocks_total == 64
            assert listener.of(ffn_id)[-1].role == "ffn"

            # -- decode at the default (max) clock --------------------------------------------------
            # two sequences with the same prompt: "a" decodes at the max clock, "b" later at the min
            # clock, over the same contexts, so only the clock differs between the two
            done = await send(m, [SeqWork(seq_id=s, token_ids=PROMPT, start_pos=0, sample=True, sampling=GREEDY)
                                  for s in ("a", "b")], "prefill")
            dones.append(done)
            first = {r.seq_id: r.token_id for r in done.results}
            assert first["a"] is not None and first["a"] == first["b"]

            async def decode_steps(seq_id: str, n: int) -> None:
                pos, token = len(PROMPT), first[seq_id]
                for _ in range(n):
                    d = await send(m, [SeqWork(seq_id=seq_id, token_ids=[token], start_pos=pos, sample=True)],
                                   "decode")
                    assert d.error is None, d
                    dones.append(d)
                    pos += 1
                    token = d.results[0].token_id

            t_fast = time.monotonic()
            await decode_steps("a", 3)
            await asyncio.sleep(2.5 / HZ)  # the periods that saw the work get published
            fast = {wid: mean_latency_ms(listener.of(wid, t_fast), "decode") for wid in (attn_id, ffn_id)}
            tel = listener.of(attn_id, t_fast)
            assert max(t.utilization for t in tel) > 0 and tel[-1].microbatches_done >= 4
            assert tel[-1].tokens_done >= 2 * len(PROMPT) + 3

            # -- commands that must be ignored ------------------------------------------------------
            now = time.time()
            await m.nc.publish(subjects.freq(attn_id), b"{not json")
            await m.nc.publish(subjects.freq(attn_id), encode(FrequencyCommand(
                worker_id="someone-else", clocks_mhz={"decode": 210}, valid_until_ts=now + 60, issued_ts=now)))
            await m.nc.flush()
            await until(lambda: m.attention.gpu is not None and m.attention.gpu.commands_ignored == 2, 1.0)

            # -- a command lowers both workers' clocks within one telemetry period ------------------
            sent = time.monotonic()
            for wid in (attn_id, ffn_id):
                await m.nc.publish(subjects.freq(wid), encode(FrequencyCommand(
                    worker_id=wid, clocks_mhz={"prefill": 200, "decode": 200}, valid_until_ts=time.time() + 60,
                    issued_ts=time.time(), reason="test")))
            for wid in (attn_id, ffn_id):
                elapsed = await until(lambda w=wid: any(t.clock_mhz == 210 for t in listener.of(w, sent)), 2.0)
                assert elapsed <= 1.0 / HZ + 0.15, f"{wid}: clock reported after {elapsed:.3f} s"
            slow_tel = [t for t in listener.of(attn_id, sent) if t.clock_mhz == 210][-1]
            assert slow_tel.target_clock_mhz == 210 and slow_tel.command_applied

            t_slow = time.monotonic()
            await decode_steps("b", 3)
            await asyncio.sleep(2.5 / HZ)
            slow = {wid: mean_latency_ms(listener.of(wid, t_slow), "decode") for wid in (attn_id, ffn_id)}
            for wid in (attn_id, ffn_id):
                assert slow[wid] > fast[wid], f"{wid}: {fast[wid]:.4f} ms at 1410 MHz, {slow[wid]:.4f} at 210"

    run_async(body, timeout_s=40)
    energy_end = sum(g.total_energy_j() for g in gpus.values())

    # after stop both clocks were reset (the emulated switch takes effect after its delay)
    time.sleep(0.05)
    assert all(g.sm_clock_mhz() == 1410 for g in gpus.values())

    # the FFN's energy reaches the attention worker in the seam replies' headers, summed per microbatch
    assert sum(d.ffn_energy_j for d in dones) < energy_end - energy_start
    total_energy = 0.0
    for done in dones:
        e, ea, ef = done.energy_j, done.attention_energy_j, done.ffn_energy_j
        assert e > 0 and ea > 0 and ef > 0 and e == pytest.approx(ea + ef)
        total_energy += e
    assert total_energy <= energy_end - energy_start

"""The attention and FFN workers on a real nats-server, with the test playing the scheduler.

Both workers run in-process as asyncio tasks; the test answers their registrations, publishes
microbatch descriptors and collects `MicrobatchDone` messages. Greedy tokens through the mesh
must equal the in-process `Engine` token for token.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.attention_worker import AttentionWorker
from services.ffn_worker import FFNWorker
from shared import subjects
from shared.engine import Engine
from shared.gpu.base import GPU
from shared.messages import (
    MicrobatchDescriptor,
    MicrobatchDone,
    Register,
    RegisterReply,
    SamplingSpec,
    SeqWork,
    decode,
    encode,
)
from shared.model.checkpoint import open_checkpoint
from shared.model.ffn import FFNHalf
from shared.model.sampling import SamplingParams
from shared.model.weights import load_ffn_half
from shared.settings import AttentionWorkerSettings, FFNWorkerSettings
from shared.transport import bus
from shared.transport.header import error_text, header_for
from shared.transport.seam import Frame, Peer, Seam
from shared.transport.seam_factory import make_seam

PROMPT_A = [5, 17, 33, 101, 7, 250, 11, 64, 3]
PROMPT_B = [9, 8, 200, 31, 4, 77]
NEW_TOKENS = 8
GREEDY = SamplingSpec(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@dataclass
class Mesh:
    """The test's side of the mesh: a scheduler stand-in and the two workers it talks to."""

    nc: Client
    attention: AttentionWorker
    ffn: FFNWorker
    registrations: list[Register] = field(default_factory=list)
    done: dict[str, asyncio.Future[MicrobatchDone]] = field(default_factory=dict)
    counter: int = 0

    def descriptor(self, seqs: list[SeqWork], release: list[str] | None = None) -> MicrobatchDescriptor:
        self.counter += 1
        return MicrobatchDescriptor(mb_id=f"mb{self.counter}", iteration=self.counter, phase="mixed",
                                    ffn_worker=self.ffn.worker_id, seqs=seqs, release=release or [])

    def expect(self, mb_id: str) -> asyncio.Future[MicrobatchDone]:
        return self.done.setdefault(mb_id, asyncio.get_running_loop().create_future())

    async def send(self, desc: MicrobatchDescriptor) -> MicrobatchDone:
        future = self.expect(desc.mb_id)
        await self.nc.publish(subjects.attn_mb(self.attention.worker_id), encode(desc))
        return await asyncio.wait_for(future, 10)


@contextlib.asynccontextmanager
async def mesh(nats_url: str, checkpoint: Path, *, num_kv_blocks: int = 64, block_size: int = 4,
               worker_settings: dict[str, Any] | None = None, attention_gpu: GPU | None = None,
               ffn_gpu: GPU | None = None) -> AsyncIterator[Mesh]:
    """Both workers on `nats_url`; `worker_settings` go to both (e.g. telemetry_hz), GPUs are injected."""
    suffix = uuid.uuid4().hex[:8]
    extra: dict[str, Any] = {"gpu_backend": "emulated", **(worker_settings or {})}
    attention = AttentionWorker(AttentionWorkerSettings(
        nats_url=nats_url, worker_id=f"attn-{suffix}", model=str(checkpoint), num_kv_blocks=num_kv_blocks,
        block_size=block_size, heartbeat_period_s=0.2, register_timeout_s=10, **extra), ffn_reply_timeout_s=5,
        gpu=attention_gpu)
    ffn = FFNWorker(FFNWorkerSettings(nats_url=nats_url, worker_id=f"ffn-{suffix}", model=str(checkpoint),
                                      heartbeat_period_s=0.2, register_timeout_s=10, **extra), gpu=ffn_gpu)
    nc = await bus.connect(nats_url, name="test-scheduler")
    state = Mesh(nc, attention, ffn)
    registered = {attention.worker_id: asyncio.Event(), ffn.worker_id: asyncio.Event()}

    async def on_register(msg: Msg) -> None:
        reg = decode(Register, msg.data)
        if reg.worker_id in registered:
            state.registrations.append(reg)
            registered[reg.worker_id].set()
            await msg.respond(encode(RegisterReply(ok=True, scheduler_id="test")))

    async def on_done(msg: Msg) -> None:
        done = decode(MicrobatchDone, msg.data)
        if done.worker_id == attention.worker_id:
            future = state.expect(done.mb_id)
            if not future.done():
                future.set_result(done)

    await nc.subscribe(subjects.CONTROL_REGISTER, cb=on_register)
    await nc.subscribe(subjects.SCHED_DONE, cb=on_done)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(attention.run(stop)), asyncio.create_task(ffn.run(stop))]
    try:
        all_registered: asyncio.Future[Any] = asyncio.ensure_future(
            asyncio.gather(*(e.wait() for e in registered.values())))
        await asyncio.wait([*tasks, all_registered], timeout=20, return_when=asyncio.FIRST_COMPLETED)
        all_registered.cancel()
        for task in tasks:
            if task.done():
                task.result()  # a worker died while starting: show why
        assert all(e.is_set() for e in registered.values()), "workers did not register"
        yield state
        for task in tasks:
            assert not task.done(), "a worker stopped while serving"
    finally:
        stop.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20)
        await bus.close(nc)
    assert all(r is None for r in results), results


def run_async(fn: Callable[[], Awaitable[None]], timeout_s: float = 45) -> None:
    async def main() -> None:
        await asyncio.wait_for(fn(), timeout_s)

    asyncio.run(main())


def engine_tokens(checkpoint: Path, prompt: list[int]) -> list[int]:
    engine = Engine.from_checkpoint(open_checkpoint(str(checkpoint)), num_kv_blocks=64, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return engine.generate([prompt], params)[0].token_ids


# -- 1: token parity with the engine --------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_greedy_tokens_match_engine(arch: str, nats_url: str, tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints[arch]
    expected = {"a": engine_tokens(path, PROMPT_A), "b": engine_tokens(path, PROMPT_B)}

    async def body() -> None:
        async with mesh(nats_url, path) as m:
            got: dict[str, list[int]] = {"a": [], "b": []}
            # a: chunked prefill (4 tokens, then the rest); b: one prefill. Two microbatches in flight.
            steps = {
                "a": [SeqWork(seq_id="a", token_ids=PROMPT_A[:4], start_pos=0, sample=False, sampling=GREEDY),
                      SeqWork(seq_id="a", token_ids=PROMPT_A[4:], start_pos=4, sample=True)],
                "b": [SeqWork(seq_id="b", token_ids=PROMPT_B, start_pos=0, sample=True, sampling=GREEDY)],
            }
            pos = {"a": 0, "b": 0}
            prompts = {"a": PROMPT_A, "b": PROMPT_B}
            while any(len(got[s]) < NEW_TOKENS for s in got):
                works = {}
                for s in got:
                    if len(got[s]) >= NEW_TOKENS:
                        continue
                    if steps[s]:
                        works[s] = steps[s].pop(0)
                    else:
                        works[s] = SeqWork(seq_id=s, token_ids=[got[s][-1]], start_pos=pos[s], sample=True)
                dones = await asyncio.gather(*(m.send(m.descriptor([w])) for w in works.values()))
                for (s, work), done in zip(works.items(), dones, strict=True):
                    assert done.error is None and not done.failed_seq_ids, done
                    (result,) = done.results
                    pos[s] = work.start_pos + len(work.token_ids)
                    if work.sample:
                        assert result.token_id is not None
                        got[s].append(result.token_id)
                    else:
                        assert result.token_id is None
                    assert done.total_s >= done.attention_s > 0 and done.ffn_wait_s > 0
            assert got == expected
            assert pos["a"] == len(prompts["a"]) + NEW_TOKENS - 1
            # both sequences in one microbatch, decoding together, still match
            done = await m.send(m.descriptor([SeqWork(seq_id=s, token_ids=[got[s][-1]], start_pos=pos[s],
                                                      sample=True) for s in got]))
            assert [r.seq_id for r in done.results] == ["a", "b"] and all(r.token_id is not None
                                                                         for r in done.results)

    run_async(body)


# -- 2: the FFN worker merges queued frames of one layer from different attention workers ----------


async def _fake_attention_seam(m: Mesh, name: str) -> tuple[Seam, Peer]:
    """A seam of the test's own, as an attention worker opens it, connected to the mesh's FFN worker."""
    assert m.ffn.seam is not None
    seam = make_seam("torch", f"{name}-{uuid.uuid4().hex[:6]}", m.nc, lambda frame: None, lambda peer, why: None,
                     listen=False, nats_url=m.nc.connected_url.geturl() if m.nc.connected_url else "")
    await seam.start()
    peer = Peer(m.ffn.worker_id, m.ffn.seam.address)
    await seam.connect(peer)
    return seam, peer


class GatedFFN:
    """The FFN half, with its first forward held until `open` is set: frames queue up behind it."""

    def __init__(self, model: FFNHalf) -> None:
        self.model, self.open, self.calls = model, threading.Event(), 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            assert self.open.wait(10), "the test never opened the gate"
        return self.model(layer, x)


def test_ffn_worker_merges_frames_of_one_layer(nats_url: str, tiny_checkpoints: dict[str, Path]) -> None:
    """Frames of one layer from two attention workers share a forward; two microbatches of the same
    attention worker never do (that would put its pipeline back in lockstep)."""
    path = tiny_checkpoints["llama"]
    checkpoint = open_checkpoint(str(path))
    reference = load_ffn_half(checkpoint.args, checkpoint.tensors)
    assert isinstance(reference, FFNHalf)
    torch.manual_seed(0)
    # three attention workers; m2 is over the seam's inline size (header and payload travel apart)
    rows = {"m0": 3, "m1": 1, "m2": 5000, "m3": 2, "m4": 4}
    inputs = {mb_id: torch.randn(n, 64) for mb_id, n in rows.items()}
    layers = {"m0": 1, "m1": 1, "m2": 1, "m3": 2, "m4": 1}
    sender = {"m0": 0, "m1": 1, "m2": 2, "m3": 1, "m4": 1}

    async def body() -> None:
        async with mesh(nats_url, path) as m:
            assert isinstance(m.ffn.model, FFNHalf)
            gate = GatedFFN(m.ffn.model)
            m.ffn.model = gate  # type: ignore[assignment]
            seams = [await _fake_attention_seam(m, f"attn{i}") for i in range(3)]

            def hop(mb_id: str) -> asyncio.Future[Frame]:
                seam, peer = seams[sender[mb_id]]
                x = inputs[mb_id]
                return asyncio.ensure_future(seam.request(
                    peer, header_for("to_ffn", mb_id, layers[mb_id], "decode", x), x, timeout_s=20))

            replies = [hop("m0")]
            await until(lambda: gate.calls == 1)  # m0's forward has started, and waits at the gate
            for queued, mb_id in enumerate(("m1", "m2", "m3", "m4"), start=1):
                replies.append(hop(mb_id))
                await until(lambda n=queued: len(m.ffn.queue) == n)  # type: ignore[misc]  # queued in this order
            gate.open.set()
            got = [await asyncio.wait_for(r, 20) for r in replies]
            await until(lambda: m.ffn.frames_served == 5)  # counted on its serving thread just after each reply
            # m0 alone; m1 (attn1) with m2 (attn2), layer 1; m3 (layer 2); m4 alone: attn1's m1 went first
            assert m.ffn.forwards == 4
            with torch.inference_mode():
                for reply in got:
                    mb_id = reply.header.mb_id
                    assert reply.header.kind == "to_attention" and reply.header.layer == layers[mb_id]
                    torch.testing.assert_close(reply.tensor, reference(layers[mb_id], inputs[mb_id]),
                                               rtol=1e-5, atol=1e-5)
            for seam, _ in seams:
                await seam.close()

    run_async(body)


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait (polling) for a condition the workers' threads bring about."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


# -- 3: refused sequences, the worker keeps serving ------------------------------------------------


def test_refused_sequences_fail_alone(nats_url: str, tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["llama"]

    async def body() -> None:
        async with mesh(nats_url, path, num_kv_blocks=8, block_size=4) as m:  # room for 32 tokens
            ok = SeqWork(seq_id="ok", token_ids=PROMPT_B, start_pos=0, sample=True, sampling=GREEDY)
            too_long = SeqWork(seq_id="long", token_ids=list(range(1, 41)), start_pos=0, sample=True,
                               sampling=GREEDY)
            done = await m.send(m.descriptor([ok, too_long]))
            assert done.failed_seq_ids == ["long"]
            assert done.error is not None and done.error.code == "kv_cache_exhausted"
            assert [r.seq_id for r in done.results] == ["ok"] and done.results[0].token_id is not None
            assert done.kv_free_blocks == 8 - 2  # "ok" holds 6 tokens = 2 blocks; "long" left nothing behind

            wrong = SeqWork(seq_id="ok", token_ids=[done.results[0].token_id], start_pos=3, sample=True)
            done = await m.send(m.descriptor([wrong]))
            assert done.failed_seq_ids == ["ok"] and done.results == []
            assert done.error is not None and done.error.code == "start_pos_mismatch"
            assert "computed 6" in done.error.message

            unknown = SeqWork(seq_id="ghost", token_ids=[1], start_pos=5, sample=True)
            done = await m.send(m.descriptor([unknown]))
            assert done.failed_seq_ids == ["ghost"]

            right = wrong.model_copy(update={"start_pos": 6})
            done = await m.send(m.descriptor([right]))
            assert done.error is None and done.results[0].token_id is not None

    run_async(body)


# -- 4: malformed messages ---------------------------------------------------------------------------


def test_malformed_messages_do_not_kill_workers(nats_url: str, tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["llama"]

    async def body() -> None:
        async with mesh(nats_url, path) as m:
            attn = subjects.attn_mb(m.attention.worker_id)
            bad_invalid = m.expect("bad")
            for payload in [b"hello", b"{not json", b'{"mb_id": "bad", "seqs": 5}', b"AFS1\x00\x00", b""]:
                await m.nc.publish(attn, payload)
            # seam frames the FFN worker cannot serve come back as error frames, with the reason
            seam, peer = await _fake_attention_seam(m, "stray")
            x, bad_dim = torch.zeros(2, 64), torch.zeros(2, 7)
            got: dict[str, str] = {}
            for header, tensor in [(header_for("to_ffn", "e1", 99, "decode", x), x),
                                   (header_for("to_attention", "e2", 0, "decode", x), x),
                                   (header_for("to_ffn", "e3", 0, "decode", bad_dim), bad_dim)]:
                frame = await seam.request(peer, header, tensor, timeout_s=5)
                assert frame.header.kind == "error"
                got[frame.header.mb_id] = error_text(frame.tensor)
            done = await asyncio.wait_for(bad_invalid, 5)
            assert done.error is not None and done.error.code == "invalid_descriptor"
            assert "layer 99" in got["e1"] and "'to_attention'" in got["e2"] and "[tokens, 64]" in got["e3"]
            await seam.close()
            # both workers still serve
            done = await m.send(m.descriptor([SeqWork(seq_id="s", token_ids=PROMPT_B, start_pos=0, sample=True,
                                                      sampling=GREEDY)]))
            assert done.error is None and done.results[0].token_id is not None

    run_async(body)


# -- 5: release frees KV blocks --------------------------------------------------------------------


def test_release_frees_kv_blocks(nats_url: str, tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["qwen3"]

    async def body() -> None:
        async with mesh(nats_url, path, num_kv_blocks=16, block_size=4) as m:
            done = await m.send(m.descriptor([
                SeqWork(seq_id="x", token_ids=PROMPT_A, start_pos=0, sample=True, sampling=GREEDY),
                SeqWork(seq_id="y", token_ids=PROMPT_B, start_pos=0, sample=False, sampling=GREEDY)]))
            assert done.kv_total_blocks == 16 and done.kv_free_blocks == 16 - 3 - 2
            assert done.results[1].token_id is None
            done = await m.send(m.descriptor([], release=["x", "nobody"]))
            assert done.error is None and done.kv_free_blocks == 16 - 2
            # a released sequence starts over: start_pos 0 with its sampling again
            done = await m.send(m.descriptor([SeqWork(seq_id="x", token_ids=[1], start_pos=9, sample=True)],
                                             release=["y"]))
            assert done.failed_seq_ids == ["x"] and done.kv_free_blocks == 16

    run_async(body)

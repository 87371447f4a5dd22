"""Both seam transports between two real processes: a test-side sender and an echo peer (seam_echo.py).

On a real nats-server and real gloo: frames of 0 B to 8 MB come back intact; on the torch seam a
peer that dies is reported lost (and sends to it fail), a hung one is dropped on the worker's word,
and a restarted one is reached again at its new address.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import orjson
import pytest
import torch
from torch.distributed import TCPStore

from shared.transport import bus
from shared.transport.header import HEADER_BYTES, header_for
from shared.transport.seam import Frame, Peer, Seam, SeamError, SeamTransport
from shared.transport.seam_factory import make_seam
from shared.transport.torch_pair import INLINE_BYTES
from shared.transport.torch_seam import TorchSeam
from tests.conftest import REPO_ROOT

ECHO = Path(__file__).with_name("seam_echo.py")
WAIT_S = 20.0  # a bound for "eventually" (no timing is asserted)
SIZES = [0, 1, 7, 4096, INLINE_BYTES - HEADER_BYTES, INLINE_BYTES - HEADER_BYTES + 1, 3 * (1 << 20) + 5,
         8 * (1 << 20)]  # one message, the largest one, then header and payload apart


@contextmanager
def echo_peer(transport: str, nats_url: str, worker_id: str, connect_timeout_s: float = 10.0,
              join_idle_wait_s: float | None = None) -> Iterator[tuple[subprocess.Popen[str], str]]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, str(ECHO), transport, nats_url, worker_id, str(connect_timeout_s),
                             "" if join_idle_wait_s is None else str(join_idle_wait_s)],
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address, "the echo peer did not start"
        yield proc, address
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


async def stop(proc: subprocess.Popen[str]) -> None:
    """SIGSTOP the peer and wait until the kernel shows it stopped (state T), so nothing more comes from it."""
    proc.send_signal(signal.SIGSTOP)
    for _ in range(int(WAIT_S / 0.01)):
        if Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the peer did not stop")


class Side:
    """The test's end: a requesting seam, and the peers it heard were lost."""

    def __init__(self) -> None:
        self.lost: asyncio.Queue[tuple[Peer, str]] = asyncio.Queue()
        self.seam: Seam | None = None

    async def echo(self, peer: Peer, x: torch.Tensor, mb_id: str, *, block: bool = False) -> Frame:
        assert self.seam is not None
        return await self.seam.request(peer, header_for("to_ffn", mb_id, 5, "decode", x), x, timeout_s=WAIT_S,
                                       block=block)


@asynccontextmanager
async def side(transport: SeamTransport, nats_url: str, connect_timeout_s: float = 3.0) -> AsyncIterator[Side]:
    nc = await bus.connect(nats_url, name="seam-test")
    s = Side()
    s.seam = make_seam(transport, "attn-test", nc, lambda frame: None, lambda p, why: s.lost.put_nowait((p, why)),
                       listen=False, nats_url=nats_url, connect_timeout_s=connect_timeout_s)
    await s.seam.start()
    try:
        yield s
    finally:
        await s.seam.close()
        await bus.close(nc)


@pytest.mark.parametrize("transport", ["torch", "nats"])
def test_frames_of_0_bytes_to_8_mb_arrive_intact(transport: SeamTransport, nats_url: str) -> None:
    async def body() -> None:
        with echo_peer(transport, nats_url, "ffn-echo") as (_, address):
            async with side(transport, nats_url) as s:
                assert s.seam is not None
                peer = Peer("ffn-echo", address)
                await s.seam.connect(peer)
                generator = torch.Generator().manual_seed(0)
                for i, n in enumerate(SIZES):
                    x = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator)
                    back = await s.echo(peer, x, f"mb-{n}", block=i % 2 == 1)  # on this thread, or a pool's
                    assert back.header.mb_id == f"mb-{n}" and back.header.kind == "to_attention"
                    assert back.header.energy_j == 1.5 and torch.equal(back.tensor, x), n
                for dtype in (torch.float32, torch.bfloat16, torch.float16):
                    x = torch.randn(16, 576, generator=generator).to(dtype)
                    assert torch.equal((await s.echo(peer, x, "typed")).tensor, x)
                # requests in flight together get their own replies, whatever order they come back in
                xs = [torch.full((i + 1, 8), float(i)) for i in range(6)]
                backs = await asyncio.gather(*(s.echo(peer, x, f"together-{i}") for i, x in enumerate(xs)))
                assert [b.header.mb_id for b in backs] == [f"together-{i}" for i in range(6)]
                assert all(torch.equal(b.tensor, x) for b, x in zip(backs, xs, strict=True))

    asyncio.run(body())


def test_joiners_claim_numbers_of_their_own_and_one_that_died_midway_does_not_block_the_rest(nats_url: str) -> None:
    """A join number is taken and written in one step, so the acceptor waits for each without polling; a
    joiner that took one and died before building its group costs the acceptor that group's connect timeout."""
    async def body() -> None:
        with echo_peer("torch", nats_url, "ffn-echo", connect_timeout_s=2.0) as (_, address):
            url = urlsplit(address)
            assert url.hostname and url.port
            dead_joiner = TCPStore(url.hostname, url.port, world_size=None, is_master=False,
                                   timeout=timedelta(seconds=5), wait_for_workers=False)
            claimers = [TorchSeam(f"attn-{i}", lambda frame: None, lambda peer, why: None, host="127.0.0.1",
                                  listen=False) for i in range(2)]
            taken = [claimer._claim_join(dead_joiner) for claimer in claimers]  # never built: both died
            assert taken == [1, 2]
            assert orjson.loads(dead_joiner.get("aflex/join/2"))["worker_id"] == "attn-1"
            async with side("torch", nats_url, connect_timeout_s=20.0) as s:
                assert s.seam is not None
                peer = Peer("ffn-echo", address)
                await s.seam.connect(peer)  # number 3, built once the acceptor gave up on 1 and 2
                x = torch.randn(4, 64)
                assert torch.equal((await s.echo(peer, x, "after-the-dead-joiners")).tensor, x)

    asyncio.run(body())


def test_the_acceptor_waits_again_after_a_quiet_spell(nats_url: str) -> None:
    """An FFN worker that no attention worker joined for a while still accepts one (its acceptor's wait for
    the next join timed out three times meanwhile, here after 0.2 s each)."""
    async def body() -> None:
        with echo_peer("torch", nats_url, "ffn-echo", join_idle_wait_s=0.2) as (proc, address):
            await asyncio.sleep(0.7)  # the quiet spell: nothing here depends on how long it lasts beyond 0.2 s
            async with side("torch", nats_url) as s:
                assert s.seam is not None
                peer = Peer("ffn-echo", address)
                await s.seam.connect(peer)
                x = torch.randn(4, 64)
                assert torch.equal((await s.echo(peer, x, "after-the-quiet")).tensor, x)
            assert proc.poll() is None

    asyncio.run(body())


@asynccontextmanager
async def warm_peer(s: Side, nats_url: str) -> AsyncIterator[tuple[subprocess.Popen[str], Peer]]:
    """A torch echo peer, connected, that has answered one request."""
    assert s.seam is not None
    with echo_peer("torch", nats_url, "ffn-echo") as (proc, address):
        peer = Peer("ffn-echo", address)
        await s.seam.connect(peer)
        x = torch.randn(4, 64)
        assert torch.equal((await s.echo(peer, x, "warm")).tensor, x)
        yield proc, peer


def test_a_killed_peer_is_reported_lost_and_a_restarted_one_is_reached_again(nats_url: str) -> None:
    async def body() -> None:
        async with side("torch", nats_url) as s:
            assert s.seam is not None
            x = torch.randn(4, 64)
            async with warm_peer(s, nats_url) as (proc, peer):
                await stop(proc)  # so that the request is still in flight when the peer dies
                waiting = asyncio.ensure_future(s.echo(peer, torch.randn(4, 64), "in-flight"))
                await asyncio.sleep(0.2)
                assert not waiting.done()
                proc.send_signal(signal.SIGKILL)
                with pytest.raises(SeamError):
                    await waiting  # fails, not hangs
                lost, why = await asyncio.wait_for(s.lost.get(), WAIT_S)
                assert lost == peer and "no reply" in why
                with pytest.raises(SeamError, match="no seam open"):
                    await s.echo(peer, x, "after")
            with echo_peer("torch", nats_url, "ffn-echo") as (_, new_address):  # the restarted worker
                assert new_address != peer.address
                again = Peer("ffn-echo", new_address)
                await s.seam.connect(again)
                assert torch.equal((await s.echo(again, x, "rejoined")).tensor, x)

    asyncio.run(body())


def test_a_hung_peer_is_dropped_and_nothing_waits_on_it(nats_url: str) -> None:
    async def body() -> None:
        async with side("torch", nats_url) as s:
            assert s.seam is not None
            x = torch.randn(4, 64)
            async with warm_peer(s, nats_url) as (proc, peer):
                await stop(proc)  # alive but silent: TCP stays up, nothing answers
                try:
                    stuck = asyncio.ensure_future(s.echo(peer, x, "stuck"))
                    await asyncio.sleep(0.2)
                    assert not stuck.done()
                    s.seam.drop(peer, "no heartbeat")  # what the attention worker does when heartbeats stop
                    with pytest.raises(SeamError):
                        await asyncio.wait_for(stuck, WAIT_S)
                    lost, why = await asyncio.wait_for(s.lost.get(), WAIT_S)
                    assert lost == peer and why == "no heartbeat"
                    with pytest.raises(SeamError):
                        await s.echo(peer, x, "after")
                finally:
                    proc.send_signal(signal.SIGCONT)

    asyncio.run(body())


def test_an_unreachable_address_is_a_clear_error(nats_url: str) -> None:
    async def body() -> None:
        async with side("torch", nats_url) as s:
            assert s.seam is not None
            with pytest.raises(SeamError, match="cannot open the seam to ffn-x"):
                await s.seam.connect(Peer("ffn-x", "gloo://127.0.0.1:1"))
            with pytest.raises(SeamError, match="not a torch seam address"):
                await s.seam.connect(Peer("ffn-y", "aflex.v1.seam.ffn-y"))

    asyncio.run(body())

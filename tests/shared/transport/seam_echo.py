"""A seam echo peer for the transport tests: listens on a seam, answers each frame with its tensor.

    python seam_echo.py torch|nats <nats_url> <worker_id> [connect_timeout_s] [join_idle_wait_s]

Prints its address on the first line, then echoes until stdin closes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from datetime import timedelta

from shared.transport import bus, torch_seam
from shared.transport.seam import Frame, Peer
from shared.transport.seam_factory import make_seam


async def main(transport: str, nats_url: str, worker_id: str, connect_timeout_s: str = "10",
               join_idle_wait_s: str = "") -> None:
    if join_idle_wait_s:  # how long the acceptor waits for a join before it waits again
        torch_seam.JOIN_IDLE_WAIT = timedelta(seconds=float(join_idle_wait_s))
    nc = await bus.connect(nats_url, name=f"echo-{worker_id}")
    seam = None

    def echo(frame: Frame) -> None:
        assert seam is not None
        seam.reply(frame, dataclasses.replace(frame.header, kind="to_attention", energy_j=1.5), frame.tensor)

    def lost(peer: Peer, reason: str) -> None:
        print(f"lost {peer.worker_id}", flush=True)

    seam = make_seam(transport, worker_id, nc, echo, lost, listen=True, nats_url=nats_url,  # type: ignore[arg-type]
                     connect_timeout_s=float(connect_timeout_s))
    await seam.start()
    print(seam.address, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await seam.close()
    await bus.close(nc)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))

"""The seam a worker's settings name, built in one place for both worker kinds."""

from __future__ import annotations

from nats.aio.client import Client

from shared.transport.seam import OnFrame, OnPeerLost, Seam, SeamTransport


def make_seam(transport: SeamTransport, worker_id: str, nc: Client, on_frame: OnFrame, on_peer_lost: OnPeerLost, *,
              listen: bool, nats_url: str, device: str = "cpu", host: str = "", connect_timeout_s: float = 10.0
              ) -> Seam:
    """`listen`: this end is reached by address (the FFN worker); `host`: the address advertised for
    the torch seam ("" = this machine's address on the route to the NATS server)."""
    if transport == "nats":
        from shared.transport.nats_seam import NatsSeam

        return NatsSeam(worker_id, nc, on_frame, on_peer_lost)
    from shared.transport.torch_seam import TorchSeam, local_host_towards

    return TorchSeam(worker_id, on_frame, on_peer_lost, host=host or local_host_towards(nats_url), listen=listen,
                     device=device, connect_timeout_s=connect_timeout_s)

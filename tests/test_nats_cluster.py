"""`aflex up --nats-cluster 3`: a node of the NATS cluster killed mid-stream loses nothing.

Three embedded nats-servers joined by routes; the services spread over them, each listing the nodes
from its own on. With 8 greedy streams decoding, the node the gateway is on is SIGKILLed; then,
again, the node it moved to. Every client fails over to the next node, the gateway asks for any
deltas it missed (`resync`), and every stream ends whole with the no-fault text.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from tests.test_mesh_faults import MAX_TOKENS, _run
from tools.launch import aflex_up


def test_killing_nats_nodes_mid_stream_loses_nothing(tiny_chat_checkpoint: Path) -> None:
    with aflex_up(str(tiny_chat_checkpoint), "--nats-cluster", "3", "--microbatch-depth", "2") as mesh:
        nodes = mesh.nats_nodes()
        assert len(nodes) == 3 and "nats-server cluster of 3 nodes" in mesh.output()
        clients = {name for node in nodes for name in node.client_names()}
        assert {"aflex-gateway", "aflex-scheduler-scheduler-0", "aflex-attention-attn-0", "aflex-ffn-ffn-0"} <= clients
        assert len({node.port for node in nodes if node.client_names()}) == 3  # spread over all three
        baseline = asyncio.run(_run(mesh))
        killed = []
        for _ in range(2):  # the gateway's node, then the one it failed over to
            node = mesh.nats_node_of("aflex-gateway")
            after_fault = asyncio.run(_run(mesh, fault=lambda node=node: os.kill(node.pid, signal.SIGKILL)))  # type: ignore[misc]
            killed.append(node.port)
            assert [tokens for _, tokens in after_fault] == [MAX_TOKENS] * 8
            assert after_fault == baseline
        assert len(set(killed)) == 2 and len(mesh.nats_nodes()) == 1
        log = mesh.output()
    # the gateway's connection was the one cut, both times (whether deltas were lost with it, and resent
    # after a resync, depends on timing: tests/services/scheduler/test_scheduler_resync.py covers resending)
    assert log.count("aflex-gateway: disconnected from NATS") >= 2

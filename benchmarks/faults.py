"""Faults, measured: what streaming clients see when a part of the mesh dies mid-stream.

    python benchmarks/faults.py --json out/faults.json            # every fault
    python benchmarks/faults.py --faults scheduler,ffn-worker

For each fault a fresh `aflex up` serves `--streams` greedy streams; once every stream is decoding
the part is killed (SIGKILL; `nats-restart` stops the nats-server and starts a new one on its port;
`nats-node` runs `aflex up --nats-cluster 3` and kills the node the gateway is connected to; `ffn-rank`
and `attention-rank-hang` run worker groups, `--attention-tp 3 --ffn-tp 2`, with a 3 s group timeout, and
SIGKILL the FFN group's rank 1 or SIGSTOP the attention group's).
Reported per fault: streams completed whole, streams whose text differs from the no-fault run of
the same mesh, the longest pause between two chunks of any stream (the stall the fault caused) next
to the longest pause of the no-fault run, and how long the whole batch took.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.transport.nats_server import EmbeddedNatsServer, free_port
from tools.launch import Mesh, aflex_up
from tools.story_stream import StoryStream, stream_story

FAULTS = ("attention-worker", "ffn-worker", "scheduler", "gateway", "nats-restart", "nats-node", "ffn-rank",
          "attention-rank-hang")
GROUPS = ("--attention-tp", "3", "--ffn-tp", "2")  # the rank faults' mesh (SmolLM2: 9 heads, 3 KV heads)


async def stream(client: openai.AsyncOpenAI, model: str, i: int, started: asyncio.Event, max_tokens: int
                 ) -> dict[str, object]:
    story = StoryStream()
    try:
        await stream_story(client, model, i, started, max_tokens, story)
    except openai.APIError as exc:
        started.set()
        return {"text": story.text, "tokens": story.tokens, "gap_s": story.longest_gap_s,
                "error": f"{type(exc).__name__}: {exc}"}
    return {"text": story.text, "tokens": story.tokens, "gap_s": story.longest_gap_s, "error": None}


async def batch(base_url: str, n: int, max_tokens: int, fault: Callable[[], None] | None,
                doomed_url: str | None = None) -> tuple[list[dict], float, list[dict]]:
    """`n` streams on `base_url` (and `n // 2` on `doomed_url`, the gateway the fault kills)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    other = openai.AsyncOpenAI(base_url=doomed_url or base_url, api_key="unused", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    n_doomed = n // 2 if doomed_url else 0
    started = [asyncio.Event() for _ in range(n + n_doomed)]
    t0 = time.monotonic()
    tasks = [asyncio.create_task(stream(client, model, i, started[i], max_tokens)) for i in range(n)]
    doomed = [asyncio.create_task(stream(other, model, 100 + i, started[n + i], max_tokens)) for i in range(n_doomed)]
    if fault is not None:
        await asyncio.gather(*(e.wait() for e in started))
        fault()
    results = await asyncio.gather(*tasks)
    elapsed = time.monotonic() - t0
    lost = await asyncio.gather(*doomed)
    await client.close()
    await other.close()
    return list(results), elapsed, list(lost)


def kill(mesh: Mesh, name: str) -> Callable[[], None]:
    return lambda: os.kill(mesh.pid_of(name), signal.SIGKILL)


def run_fault(args: argparse.Namespace, fault: str) -> dict[str, object]:
    extra = ["--attention-workers", "2" if fault == "attention-worker" else "1",
             "--ffn-workers", "2" if fault == "ffn-worker" else "1", "--gateways", "2" if fault == "gateway" else "1",
             *(["--nats-cluster", "3"] if fault == "nats-node" else []), *(GROUPS if "rank" in fault else ())]
    port = free_port()
    servers = [EmbeddedNatsServer(port=port).start()] if fault == "nats-restart" else []

    def restart_nats() -> None:
        servers[-1].stop()
        servers.append(EmbeddedNatsServer(port=port).start())

    try:
        with aflex_up(args.model, *extra, nats_url=servers[0].url if servers else None,
                      env_extra={"AFLEX_GROUP_TIMEOUT_S": "3"} if "rank" in fault else None) as mesh:
            base = mesh.base_url
            second = base.replace(f":{mesh.port}/", f":{mesh.port + 1}/") if fault == "gateway" else None
            baseline, baseline_s, _ = asyncio.run(batch(base, args.streams, args.max_tokens, None))
            action = {"attention-worker": kill(mesh, "attn-0"), "ffn-worker": kill(mesh, "ffn-0"),
                      "scheduler": kill(mesh, "scheduler"), "nats-restart": restart_nats,
                      "gateway": kill(mesh, f"gateway:{mesh.port + 1}"),
                      "nats-node": lambda: os.kill(mesh.nats_node_of("aflex-gateway").pid, signal.SIGKILL),
                      "ffn-rank": lambda: os.kill(mesh.rank_pid("ffn-0"), signal.SIGKILL),
                      "attention-rank-hang": lambda: os.kill(mesh.rank_pid("attn-0"), signal.SIGSTOP)}[fault]
            faulted, faulted_s, on_killed = asyncio.run(batch(base, args.streams, args.max_tokens, action, second))
            cancelled = "is gone: cancelling its" in mesh.output()
    finally:
        for server in servers[-1:]:
            server.stop()
    whole = [r for r in faulted if r["error"] is None and r["tokens"] == args.max_tokens]
    same = sum(r["text"] == b["text"] for r, b in zip(faulted, baseline, strict=True))
    return {"fault": fault, "streams": args.streams, "completed_whole": len(whole),
            "text_equal_to_no_fault": same, "errors": [r["error"] for r in faulted if r["error"]][:3],
            "longest_pause_s": round(max(float(r["gap_s"]) for r in faulted), 3),  # type: ignore[arg-type]
            "no_fault_longest_pause_s": round(max(float(r["gap_s"]) for r in baseline), 3),  # type: ignore[arg-type]
            "batch_s": round(faulted_s, 2), "no_fault_batch_s": round(baseline_s, 2),
            **({"streams_on_the_killed_gateway": len(on_killed),
                "their_connection_dropped": sum(r["error"] is not None for r in on_killed),
                "their_requests_cancelled_in_the_scheduler": cancelled} if fault == "gateway" else {})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for fault in args.faults.split(","):
        row = run_fault(args, fault)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"faults": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Record every message on a NATS subject as JSON lines, until SIGTERM or SIGINT (a benchmark's witness).

    python -m tools.record_subject --nats nats://telemetry:pw@127.0.0.1:4222 --subject aflex.v1.telemetry.plan \
        --out out/bench/live-plans.jsonl

Each line is {"received_ts": unix seconds, "subject": ..., "data": the message's JSON}.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import orjson

from shared.lifecycle import stop_on_signals
from shared.transport import bus


async def record(nats_url: str, subject: str, out: Path) -> int:
    stop = asyncio.Event()
    count = 0
    with stop_on_signals(stop), out.open("wb") as sink:
        nc = await bus.connect(nats_url, name="aflex-record")

        async def on_msg(msg: object) -> None:
            nonlocal count
            line = {"received_ts": time.time(), "subject": msg.subject,  # type: ignore[attr-defined]
                    "data": orjson.loads(msg.data)}  # type: ignore[attr-defined]
            sink.write(orjson.dumps(line) + b"\n")
            sink.flush()
            count += 1

        await nc.subscribe(subject, cb=on_msg)
        await stop.wait()
        await bus.close(nc)
    return count


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.record_subject", description=__doc__.splitlines()[0])
    parser.add_argument("--nats", required=True)
    parser.add_argument("--subject", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    count = asyncio.run(record(args.nats, args.subject, args.out))
    print(f"recorded {count} messages on {args.subject} in {args.out}")


if __name__ == "__main__":
    main()

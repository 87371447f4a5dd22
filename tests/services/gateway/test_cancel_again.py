"""A cancel sent around a NATS connection's return may be lost: the gateway's watch sends it again when
that scheduler run's loss epoch moves (its heartbeat's `reconnects`), once per move, and only to it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import nats
from nats.aio.msg import Msg

from services.gateway.liveness import SchedulerWatch
from shared import subjects
from shared.messages import CancelRequest, SchedulerHeartbeat, decode, encode


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_cancel_is_sent_again_when_its_scheduler_runs_connection_came_back(nats_url: str) -> None:
    async def main() -> None:
        gateway, scheduler = await nats.connect(nats_url), await nats.connect(nats_url)
        got: list[CancelRequest] = []

        async def on_cancel(msg: Msg) -> None:
            got.append(decode(CancelRequest, msg.data))

        await scheduler.subscribe(subjects.REQ_CANCEL_ALL, cb=on_cancel)
        watch = SchedulerWatch()
        await watch.subscribe(gateway)
        await scheduler.flush()
        await gateway.flush()

        async def beat(instance: str, reconnects: int) -> None:
            await scheduler.publish(subjects.SCHED_HEARTBEAT, encode(SchedulerHeartbeat(
                scheduler_id="s", instance=instance, ts=0.0, reconnects=reconnects)))
            await until(lambda: watch._reconnects.get(instance) == reconnects and watch._epochs.get(instance) ==
                        watch.loss_epoch(instance))

        await beat("run-1", 0)
        await beat("run-2", 0)
        watch.cancelled(CancelRequest(request_id="r1", reason="client_disconnected", arrival_ts=5.0), "run-1")
        watch.cancelled(CancelRequest(request_id="r2", reason="stop_string"), "run-2")
        watch.cancelled(CancelRequest(request_id="r3"), "")  # never taken by a run: nothing to send again
        await beat("run-1", 0)  # nothing came back: nothing sent
        await beat("run-1", 1)  # run-1's connection came back: r1 again
        await beat("run-1", 1)
        await beat("run-1", 2)  # and once more on the next move
        await gateway.flush()
        await until(lambda: len(got) >= 2)
        await gateway.flush()
        await scheduler.flush()
        assert [(c.request_id, c.reason, c.arrival_ts) for c in got] == [("r1", "client_disconnected", 5.0)] * 2
        await gateway.close()
        await scheduler.close()
    asyncio.run(main())

"""FFNWatch: a hop fails once its FFN worker has been silent for `silence_s` since the hop was sent."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from services.attention_worker.ffn_watch import FFNWatch
from shared import subjects
from shared.messages import Heartbeat, encode
from shared.transport import bus


def test_only_hops_on_a_silent_ffn_worker_fail_once() -> None:
    failed: list[tuple[tuple[str, int], str]] = []
    watch = FFNWatch(5.0, lambda key, ffn, silent_s: failed.append((key, ffn)))
    watch.track(("mb-1", 3), "ffn-0", now=100.0)
    watch.track(("mb-2", 3), "ffn-1", now=100.0)
    watch.check(104.0)
    assert failed == []  # not silent long enough yet
    watch.heard("ffn-1", "ffn", 103.0)  # ffn-1 is alive
    watch.heard("ffn-0", "attention", 103.0)  # another role's heartbeat with that id does not count
    watch.heard("ffn-0", "ffn", 99.0)  # a heartbeat from before the hop was sent does not either
    watch.check(105.5)
    assert failed == [(("mb-1", 3), "ffn-0")]
    watch.check(107.9)  # reported once; ffn-1 heard 4.9 s ago: its hop still waits
    assert failed == [(("mb-1", 3), "ffn-0")]
    watch.check(108.5)
    assert failed == [(("mb-1", 3), "ffn-0"), (("mb-2", 3), "ffn-1")]


def test_heartbeats_are_read_from_the_wire_and_answered_hops_forgotten() -> None:
    failed: list[str] = []
    watch = FFNWatch(5.0, lambda key, ffn, silent_s: failed.append(ffn))
    watch.track(("mb-1", 0), "ffn-0")
    beat = Heartbeat(worker_id="ffn-0", role="ffn", ts=time.time())
    asyncio.run(watch._on_heartbeat(SimpleNamespace(data=encode(beat))))  # type: ignore[arg-type]
    asyncio.run(watch._on_heartbeat(SimpleNamespace(data=b"not json")))  # type: ignore[arg-type]  # ignored
    watch.check(time.monotonic() + 4.0)
    assert failed == []
    watch.untrack(("mb-1", 0))
    watch.check(time.monotonic() + 60.0)
    assert failed == []


def test_zero_switches_the_silence_checks_off_but_addresses_are_still_learnt(nats_url: str) -> None:
    async def main() -> None:
        nc = await bus.connect(nats_url, name="watch-test")
        off = FFNWatch(0.0, lambda *_: None)
        await off.start(nc)
        try:
            assert off._task is None  # no silence checks
            beat = Heartbeat(worker_id="ffn-9", role="ffn", ts=time.time(), seam_address="gloo://10.0.0.9:4000")
            waiting = asyncio.ensure_future(off.address_of("ffn-9", 10.0))
            await nc.publish(subjects.heartbeat("ffn-9"), encode(beat))
            assert await asyncio.wait_for(waiting, 10.0) == "gloo://10.0.0.9:4000"
            assert await off.address_of("ffn-unknown", 0.05) == ""  # never heard of: empty, not a hang
        finally:
            await off.stop()
            await bus.close(nc)

    asyncio.run(main())

"""Overload, bounded: 10x what the mesh serves, open loop; the excess gets 429 with Retry-After at once.

`aflex up` with a tiny model; capacity is measured first (closed loop), then ten times that rate is
offered for a few seconds. Every request gets a 200 with a whole stream or a 429 with `Retry-After`
(the queue is full, or it waited `queue_deadline_s` without starting; a streamed request's status line
waits for its first token, so a shed stream is a real 429): no timeout, no dropped connection, no error
event. Right after, the mesh serves as before. The
latency and memory figures are the benchmark's (benchmarks/overload.py), not asserted here.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from loadgen.overload import capacity, overload
from tools.launch import aflex_up

MAX_TOKENS = 48


def test_ten_times_capacity_gets_429s_with_retry_after_and_nothing_else(tiny_chat_checkpoint: Path) -> None:
    shedding = {"AFLEX_QUEUE_DEADLINE_S": "1.0", "AFLEX_MAX_QUEUE": "16"}  # both limits: a wait and a length
    with aflex_up(str(tiny_chat_checkpoint), env_extra=shedding) as mesh:
        model = mesh.served_model()
        rss_before = {name: mesh.rss_mb(name) for name in ("gateway", "scheduler")}
        rate = asyncio.run(capacity(mesh.base_url, model, seconds=3, concurrency=16, max_tokens=MAX_TOKENS))
        heavy = asyncio.run(overload(mesh.base_url, model, rate_per_s=10 * rate, seconds=8, max_tokens=MAX_TOKENS))
        after = asyncio.run(overload(mesh.base_url, model, rate_per_s=rate / 2, seconds=2, max_tokens=MAX_TOKENS))
        rss_after = {name: mesh.rss_mb(name) for name in ("gateway", "scheduler")}
        assert mesh.process.poll() is None
    print(f"capacity {rate:.1f}/s; offered {10 * rate:.1f}/s: {dict(heavy.statuses)} {dict(heavy.refusal_codes)}; "
          f"RSS MiB before {rss_before}, after {rss_after}")
    assert heavy.failures == [], heavy.failures[:5]  # no timeout, dropped connection or error event
    assert set(heavy.statuses) <= {200, 429} and heavy.statuses[429] > 0 and heavy.statuses[200] > 0, heavy.statuses
    assert heavy.without_retry_after == 0
    assert set(heavy.refusal_codes) <= {"queue_full", "queue_deadline"}, heavy.refusal_codes
    assert after.failures == [] and dict(after.statuses) == {200: len(after.served_e2e_s)}, (after.statuses,
                                                                                            after.failures[:3])

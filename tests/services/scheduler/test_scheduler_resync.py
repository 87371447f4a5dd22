"""A gateway that may have missed deltas resubmits with `resync`: the scheduler sends them again.

On a real nats-server with tests/test_scheduler.py's fake workers: a request is resynced while it
runs and after it finished (every delta sent again equals the first one of its index, the final
one too), and a resync the scheduler knows nothing of is taken as a continuation.
"""

from __future__ import annotations

import asyncio
import time

from shared import subjects
from shared.messages import OutputDelta, SamplingSpec, SubmitReply, SubmitRequest, decode, encode
from tests.services.scheduler.test_scheduler import FakeAttention, Mesh, collect, mesh, tokens


async def _resync(m: Mesh, rid: str, first_index: int, generated: list[int], max_tokens: int) -> SubmitReply:
    req = SubmitRequest(request_id=rid, model="test-model", prompt_ids=[5, 6], arrival_ts=time.time(),
                        sampling=SamplingSpec(max_tokens=max_tokens), generated_ids=generated,
                        first_index=first_index, resync=True)
    return decode(SubmitReply, (await m.nc.request(subjects.REQ_SUBMIT, encode(req), 5)).data)


def _drain(queue: asyncio.Queue[OutputDelta]) -> list[OutputDelta]:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


def test_resync_sends_the_missed_deltas_again_while_running_and_after(nats_url: str) -> None:
    async def main() -> None:
        attn = FakeAttention(None, "a0", delay_s=0.02)  # type: ignore[arg-type]
        async with mesh(nats_url, attn=(attn,)) as m:
            queue = await m.stream("r1")
            first = await m.submit("r1", [5, 6], max_tokens=20)
            assert first.accepted
            seen = [await asyncio.wait_for(queue.get(), 5) for _ in range(5)]
            again = await _resync(m, "r1", 2, tokens(seen[:2]), 20)
            assert again.accepted and again.scheduler_instance == first.scheduler_instance
            deltas = seen + await collect(queue)
            by_index: dict[int, OutputDelta] = {}
            for delta in deltas:  # the same delta every time an index comes
                assert by_index.setdefault(delta.index, delta) == delta, delta
            assert sorted(by_index) == list(range(20)) and len(deltas) >= 20 + 3  # 2, 3, 4 at least twice
            assert tokens([by_index[i] for i in range(20)]) == [100 + i for i in range(20)]
            final = by_index[19]
            assert final.finish_reason == "length" and final.usage is not None

            _drain(queue)
            after = await _resync(m, "r1", 18, tokens([by_index[i] for i in range(18)]), 20)
            assert after.accepted
            resent = [await asyncio.wait_for(queue.get(), 5) for _ in range(2)]
            assert resent == [by_index[18], final]  # the finished request's last two, final included
            assert len(attn.seqs_of("r1")) == 20  # and nothing computed again
    asyncio.run(main())


def test_a_resync_it_does_not_know_is_a_continuation(nats_url: str) -> None:
    async def main() -> None:
        async with mesh(nats_url) as m:
            queue = await m.stream("r2")
            reply = await _resync(m, "r2", 3, [100, 101, 102], 6)
            assert reply.accepted
            deltas = await collect(queue)
            assert [d.index for d in deltas] == [3, 4, 5]
            assert tokens(deltas) == [103, 104, 105] and deltas[-1].finish_reason == "length"
    asyncio.run(main())

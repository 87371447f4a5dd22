"""A request outlives its scheduler: the gateway resubmits it, as a continuation, to the run that takes over.

A fake scheduler with heartbeats dies mid-request (its heartbeats stop, nobody answers its subjects);
a new run of it (a new `instance`) takes the continuation, which must carry exactly the tokens the
client was streamed and the next delta index; the client sees the whole text with no gap. With no
run back within `failover_deadline_s` the stream ends with an OpenAI error event and `[DONE]`, and a
non-streamed request gets a 503 with `Retry-After`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx2 as httpx
import orjson
import pytest
from nats.aio.msg import Msg

from shared import subjects
from shared.messages import OutputDelta, SchedulerHeartbeat, SubmitReply, SubmitRequest, Usage, decode, encode
from tests.services.gateway.test_gateway import MESSAGES, MODEL, TEXT, FakeScheduler, Harness


class RestartingScheduler(FakeScheduler):
    """Beats every 50 ms as run `instance`; with `die_after` set, its run dies before streaming that token
    of a request, and a new run (`revive`) starts at once unless `stay_dead`."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.run = 1
        self.die_after: int | None = None
        self.stay_dead = False
        self._beats: asyncio.Task[None] | None = None

    @property
    def instance(self) -> str:
        return f"run-{self.run}"

    async def start(self) -> None:
        await super().start()
        self._beats = asyncio.create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            beat = SchedulerHeartbeat(scheduler_id="fake", instance=self.instance, ts=0.0)
            await self.nc.publish(subjects.SCHED_HEARTBEAT, encode(beat))
            await asyncio.sleep(0.05)

    async def die(self) -> None:
        assert self._beats is not None
        self._beats.cancel()
        await self.stop()
        if not self.stay_dead:
            self.run += 1
            self.die_after = None
            await self.start()

    async def _on_submit(self, msg: Msg) -> None:
        req = decode(SubmitRequest, msg.data)
        self.submissions.append(req)
        await msg.respond(encode(SubmitReply(request_id=req.request_id, accepted=True,
                                             scheduler_instance=self.instance)))
        task = asyncio.create_task(self._stream_rest(req))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stream_rest(self, req: SubmitRequest) -> None:
        """One token a delta, from where the continuation left off."""
        tokens = self.script[:req.sampling.max_tokens]
        start = len(req.generated_ids)
        for k in range(start, len(tokens)):
            await asyncio.sleep(0.01)
            if self.die_after is not None and k == self.die_after:
                await self.die()
                return
            last = k == len(tokens) - 1
            usage = Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=len(tokens),
                          total_tokens=len(req.prompt_ids) + len(tokens)) if last else None
            await self.nc.publish(subjects.req_out(req.request_id), encode(OutputDelta(
                request_id=req.request_id, index=req.first_index + k - start, token_ids=[tokens[k]],
                finish_reason="stop" if last else None, usage=usage)))


@pytest.fixture(scope="module")
def h() -> Iterator[Harness]:
    harness = Harness(RestartingScheduler, scheduler_silence_s=0.3, failover_deadline_s=1.5, request_timeout_s=10.0)
    try:
        yield harness
    finally:
        harness.close()


@pytest.fixture(autouse=True)
def _alive(h: Harness) -> Iterator[RestartingScheduler]:
    fake = h.fake
    assert isinstance(fake, RestartingScheduler)
    fake.submissions.clear()
    yield fake
    if fake.stay_dead:  # bring a run back for the next test
        fake.stay_dead, fake.die_after = False, None
        fake.run += 1
        h.call(fake.start())


def test_a_stream_goes_on_through_a_scheduler_restart_with_no_gap(h: Harness, _alive: RestartingScheduler) -> None:
    _alive.die_after = 3
    stream = h.client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == TEXT
    first, again = _alive.submissions
    assert first.request_id == again.request_id and not first.generated_ids and first.first_index == 0
    assert again.generated_ids == _alive.script[:3]  # exactly what the client was streamed
    assert again.first_index == 3 and again.prompt_ids == first.prompt_ids and again.sampling == first.sampling


def test_a_non_streamed_request_is_answered_whole_through_a_restart(h: Harness, _alive: RestartingScheduler) -> None:
    _alive.die_after = 5
    resp = h.client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert resp.choices[0].message.content == TEXT
    assert resp.usage is not None and resp.usage.completion_tokens == len(_alive.script)
    assert len(_alive.submissions) == 2


def test_no_scheduler_back_ends_the_stream_with_an_error_event_and_done(h: Harness, _alive: RestartingScheduler
                                                                       ) -> None:
    _alive.die_after, _alive.stay_dead = 2, True
    body = {"model": MODEL, "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", f"{h.base}/v1/chat/completions", json=body, timeout=10) as response:
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = orjson.loads(events[-2])["error"]
    assert error["code"] == "scheduler_unavailable" and "no other took it over within 1.5 s" in error["message"]


def test_no_scheduler_back_is_a_503_with_retry_after(h: Harness, _alive: RestartingScheduler) -> None:
    _alive.die_after, _alive.stay_dead = 2, True
    response = httpx.post(f"{h.base}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}, timeout=10)
    assert response.status_code == 503 and response.headers["Retry-After"]
    assert response.json()["error"]["code"] == "scheduler_unavailable"

"""`ChoiceEvents` merges the n choices' events; one choice is read directly, with no reader task or queue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from services.gateway.errors import APIError
from services.gateway.generation import TextEvent
from services.gateway.streaming import ChoiceEvents


class Scripted:
    """A generation's two calls the merger makes (`events`, `release`), playing back set texts."""

    def __init__(self, texts: list[str], fail: Exception | None = None) -> None:
        self.texts, self.fail = texts, fail
        self.released: str | None = None
        self.closed = False

    async def events(self) -> AsyncIterator[TextEvent]:
        try:
            for text in self.texts:
                await asyncio.sleep(0)
                yield TextEvent(text, None, None, [], None)
            if self.fail is not None:
                raise self.fail
        finally:
            self.closed = True

    async def release(self, reason: str) -> None:
        self.released = reason


async def _drain(events: ChoiceEvents) -> list[tuple[int, str]]:
    got = []
    while (item := await events.next()) is not None:
        got.append((item[0], item[1].text))
    return got


def test_one_choice_is_read_directly_and_released_on_close() -> None:
    async def run() -> None:
        one = Scripted(["a", "b", "c"])
        events = ChoiceEvents([cast(Any, one)])
        tasks_before = len(asyncio.all_tasks())
        assert events._readers == []
        assert await _drain(events) == [(0, "a"), (0, "b"), (0, "c")]
        assert len(asyncio.all_tasks()) == tasks_before and await events.next() is None
        await events.close("done")
        assert one.released == "done" and one.closed

    asyncio.run(run())


def test_a_client_leaving_mid_stream_closes_the_direct_generation() -> None:
    async def run() -> None:
        one = Scripted(["a", "b", "c"])
        events = ChoiceEvents([cast(Any, one)])
        assert await events.next() == (0, TextEvent("a", None, None, [], None))
        await events.close("client_disconnected")
        assert one.closed and one.released == "client_disconnected"

    asyncio.run(run())


@pytest.mark.parametrize("n", [1, 2])
def test_a_failing_choice_ends_the_stream_with_an_api_error(n: int) -> None:
    async def run(fail: Exception) -> APIError:
        gens = [Scripted(["x"], fail)] + [Scripted(["y"]) for _ in range(n - 1)]
        events = ChoiceEvents([cast(Any, g) for g in gens])
        with pytest.raises(APIError) as caught:
            await _drain(events)
        await events.close("failed")
        return caught.value

    assert asyncio.run(run(RuntimeError("boom"))).status == 500
    assert asyncio.run(run(APIError(504, "too slow"))).status == 504


def test_several_choices_are_merged_with_their_indices() -> None:
    async def run() -> None:
        events = ChoiceEvents([cast(Any, Scripted(["a0", "a1"])), cast(Any, Scripted(["b0", "b1"]))])
        got = await _drain(events)
        assert sorted(got) == [(0, "a0"), (0, "a1"), (1, "b0"), (1, "b1")]
        assert [t for i, t in got if i == 0] == ["a0", "a1"] and [t for i, t in got if i == 1] == ["b0", "b1"]
        await events.close("done")

    asyncio.run(run())

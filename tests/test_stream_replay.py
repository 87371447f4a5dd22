"""Every API's answers, whole and streamed, equal the recorded ones byte for byte (ids, times and joules
aside, and a logprob's digits past this machine's float32 rounding): the answer path's renderers send what
the gateway sent before (tests/stream_replay.py)."""

from __future__ import annotations

from tests.conftest import TEST_DATA
from tests.stream_replay import CHAT_CASES, replay
from tools.launch import Mesh


def test_the_recorded_answers_come_again(chat_mesh: Mesh, chat_model: str) -> None:
    differ = replay(TEST_DATA / "streams" / "chat_model.json", chat_mesh.base_url.removesuffix("/v1"), chat_model,
                    CHAT_CASES)
    assert not differ, differ[:2]

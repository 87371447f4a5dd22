"""The reasoning splitter on scripted answers: the same split however the text arrives, markers never leaked."""

from __future__ import annotations

import random

import pytest

from services.gateway.reasoning import ReasoningSplitter, Start, ThinkTokens

SCRIPTS: list[tuple[Start, str, str, str]] = [
    # (how the answer starts, the model's text, reasoning, answer)
    ("may_open", "<think>\nTwo and two.\n</think>\n\nIt is 4.", "Two and two.", "It is 4."),
    ("may_open", "It is 4, no block.", "", "It is 4, no block."),
    ("may_open", "\n<think>a</think>b", "a", "b"),
    ("may_open", "<thinking is not the marker", "", "<thinking is not the marker"),
    ("may_open", "<think>\ncut in the middle of </thi", "cut in the middle of </thi", ""),
    ("may_open", "<think>\nlines\n\nkept inside\n\n</think>\n\n\nanswer\n\nwith lines\n", "lines\n\nkept inside",
     "answer\n\nwith lines\n"),
    ("inside", "\nreasoning at once\n</think>\n\nanswer", "reasoning at once", "answer"),
    ("inside", "never closed\n\n", "never closed\n\n", ""),
    ("inside", "a < b but </ is not </think>done", "a < b but </ is not ", "done"),
    ("off", "\n\nanswer as it is, <think> too", "", "\n\nanswer as it is, <think> too"),
    ("may_open", '<think>\ncall it\n</think>\n\n<tool_call>\n{"name": "f"}\n</tool_call>', "call it",
     '<tool_call>\n{"name": "f"}\n</tool_call>'),
]


def _split(start: Start, pieces: list[str]) -> tuple[str, str]:
    splitter = ReasoningSplitter(start)
    reasoning, answer = "", ""
    for piece in pieces:
        r, a = splitter.feed(piece)
        reasoning, answer = reasoning + r, answer + a
    r, a = splitter.finish()
    return reasoning + r, answer + a


@pytest.mark.parametrize(("start", "text", "reasoning", "answer"), SCRIPTS)
def test_split_is_the_same_in_any_pieces(start: Start, text: str, reasoning: str, answer: str) -> None:
    assert _split(start, [text]) == (reasoning, answer)
    assert _split(start, list(text)) == (reasoning, answer)  # one character at a time
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(4, len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _split(start, pieces) == (reasoning, answer)


def test_nothing_is_held_longer_than_a_marker_could_be() -> None:
    """Reasoning streams as it comes: only a possible `</think>` and the newlines before it wait."""
    splitter = ReasoningSplitter("inside")
    assert splitter.feed("one two") == ("one two", "")
    assert splitter.feed(" three\n\n</th") == (" three", "")
    assert splitter.feed("ink>\n\nfour") == ("", "four")


def test_reasoning_tokens_are_counted_until_the_close() -> None:
    tokens = ThinkTokens(open_id=7, close_id=8)
    opened = ReasoningSplitter("may_open", tokens)
    for token_id in (7, 1, 2, 8, 3, 4):
        opened.count(token_id)
    assert opened.reasoning_tokens == 4
    plain = ReasoningSplitter("may_open", tokens)
    for token_id in (1, 7, 8):
        plain.count(token_id)
    assert plain.reasoning_tokens == 0
    inside = ReasoningSplitter("inside", tokens)
    for token_id in (1, 8, 2):
        inside.count(token_id)
    assert inside.reasoning_tokens == 2

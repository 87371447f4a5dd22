"""Reasoning models: the answer's `<think>` block split from the answer, as it streams.

A checkpoint whose vocabulary holds `<think>` and `</think>` as single tokens (Qwen3, DeepSeek-R1, QwQ, ...)
reasons before it answers. Where its answer starts is read from the rendered prompt, so no template is
special-cased: a prompt that ends inside an open block (DeepSeek-R1's, Qwen3-Thinking's templates) is
answered by reasoning at once; one that ends with a closed block (Qwen3's `enable_thinking=false` renders
an empty one) is answered without reasoning; otherwise the model may open a block first (Qwen3's default).

The reasoning goes out as `reasoning_content` (chat), reasoning items (Responses) or `thinking` blocks
(Messages); the text after `</think>` is the answer, read for tool calls as any answer is. Newlines that
frame the block are dropped, as Qwen3's template drops them when it renders an earlier turn again.
A forced grammar (a required tool call, `response_format`) applies after the block (`grammar`), the way
vLLM's structured outputs wait for a reasoning parser's end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from shared.model.tokenizer import Tokenizer

OPEN, CLOSE = "<think>", "</think>"
Start = Literal["inside", "may_open", "off"]


@dataclass(frozen=True)
class ThinkTokens:
    """The served vocabulary's reasoning markers."""

    open_id: int
    close_id: int

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ThinkTokens | None:
        """The markers where both are single tokens of the vocabulary; None for a model that does not reason."""
        open_id, close_id = tokenizer.token_to_id(OPEN), tokenizer.token_to_id(CLOSE)
        if open_id is None or close_id is None:
            return None
        return cls(open_id, close_id)

    def start(self, prompt_ids: list[int], tokenizer: Tokenizer) -> Start:
        """How the answer to this prompt begins (module docstring)."""
        last_open = _last_index(prompt_ids, self.open_id)
        last_close = _last_index(prompt_ids, self.close_id)
        if last_open > last_close:
            return "inside"
        if last_close >= 0 and not tokenizer.decode(prompt_ids[last_close + 1:], skip_special_tokens=False).strip():
            return "off"
        return "may_open"

    def grammar(self, answer_lark: str, start: Start) -> str:
        """A lark grammar whose `answer` rule (in `answer_lark`) comes after the reasoning block, if any:
        token-level, so any text may be reasoned, and only the closing marker ends it."""
        block = f"<[^{self.close_id}]>* <[{self.close_id}]> /\\n*/"
        head = {"inside": f"start: think answer\nthink: {block}\n",
                "may_open": f"start: (<[{self.open_id}]> think)? answer\nthink: {block}\n",
                "off": "start: answer\n"}[start]
        return head + answer_lark


def _last_index(ids: list[int], token_id: int) -> int:
    for k in range(len(ids) - 1, -1, -1):
        if ids[k] == token_id:
            return k
    return -1


@dataclass
class ReasoningSplitter:
    """One answer's text split into (reasoning, answer) pieces as it comes, a marker never split.

    `feed` takes new text and gives the pieces that are final; text that may be the start of a marker,
    or newlines that may precede the closing one, wait for the next `feed` or for `finish`."""

    start: Start
    tokens: ThinkTokens | None = None  # with them, `count` counts the reasoning's tokens
    reasoning_tokens: int = 0
    _state: str = field(init=False)  # "start" (may open), "reasoning" or "answer"
    _held: str = field(default="", init=False)
    _began: bool = field(default=False, init=False)  # the current part has emitted text (leading newlines dropped)
    _counting: bool | None = field(default=None, init=False)  # None: the first token decides

    def __post_init__(self) -> None:
        self._state = {"inside": "reasoning", "may_open": "start", "off": "answer"}[self.start]
        self._began = self.start == "off"  # an answer after a closed prompt block keeps its text as it is
        self._counting = {"inside": True, "may_open": None, "off": False}[self.start]

    def count(self, token_id: int) -> None:
        """Count a generated token toward the reasoning while the block is open (its markers included)."""
        if self.tokens is None:
            return
        if self._counting is None:
            self._counting = token_id == self.tokens.open_id
        if self._counting:
            self.reasoning_tokens += 1
            self._counting = token_id != self.tokens.close_id

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) text that is final after `text`."""
        self._held += text
        reasoning: list[str] = []
        answer: list[str] = []
        while self._held:
            if self._state == "start":
                stripped = self._held.lstrip()
                if OPEN.startswith(stripped):  # empty, or a marker's beginning: wait
                    break
                if stripped.startswith(OPEN):
                    self._held, self._state, self._began = stripped[len(OPEN):], "reasoning", False
                    continue
                self._state = "answer"
                self._began = True  # no block: the answer is the text as it is
                continue
            if self._state == "reasoning":
                end = self._held.find(CLOSE)
                if end >= 0:
                    reasoning.append(self._begin(self._held[:end].rstrip("\n")))
                    self._held, self._state, self._began = self._held[end + len(CLOSE):], "answer", False
                    continue
                keep = _held_back(self._held)
                reasoning.append(self._begin(self._held[:len(self._held) - keep]))
                self._held = self._held[len(self._held) - keep:]
                break
            answer.append(self._begin(self._held))
            self._held = ""
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """The held text, at the end of the answer: reasoning cut by `max_tokens` stays reasoning."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return self._begin(held), ""
        if self._state == "start":
            self._began = True
        return "", self._begin(held)

    def _begin(self, text: str) -> str:
        """`text`, without the newlines that open the current part."""
        if not self._began:
            text = text.lstrip("\n")
            self._began = bool(text)
        return text


def _held_back(text: str) -> int:
    """How many characters at the end of `text` must wait: a beginning of `</think>`, and newlines before it."""
    keep = 0
    for k in range(min(len(CLOSE) - 1, len(text)), 0, -1):
        if CLOSE.startswith(text[-k:]):
            keep = k
            break
    rest = text[:len(text) - keep]
    return keep + len(rest) - len(rest.rstrip("\n"))

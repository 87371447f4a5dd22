"""Chat completions and completions: an answer's parts (services.gateway.parts) in OpenAI's shape, whole or as SSE.

Streaming follows OpenAI and vLLM: the role chunk goes out with the first token's text (an early role
chunk would fake a tiny TTFT in benchmarks), content chunks follow, the last content chunk carries
`finish_reason`; with `stream_options.include_usage` every chunk has `"usage": null` and one more chunk
with `"choices": []` carries the usage (and with vLLM's `continuous_usage_stats` every chunk carries
the usage so far); `data: [DONE]` ends the stream, also after an error event. A streamed call's first
piece carries its `id`, `type` and name, later pieces its arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.gateway.errors import APIError
from services.gateway.generation import cached_tokens, reasoning_tokens, usage_dict
from services.gateway.logprobs import Entry, LogprobFormat
from services.gateway.openai_schema import OpenAIRequest
from services.gateway.parts import Answer, Begin, CallArguments, CallStart, End, Part, Reasoning, Text
from services.gateway.streaming import DONE, Answering, Dialect, Identity, sse
from shared.model.tokenizer import Tokenizer


def total_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """The n choices' usage as one: the prompt counted once (as vLLM does), the completions summed."""
    energies = [u.get("energy_j") for u in usages]
    energy_j = None if any(e is None for e in energies) else sum(e for e in energies if e is not None)
    total = usage_dict(usages[0]["prompt_tokens"], sum(u["completion_tokens"] for u in usages), energy_j,
                       cached_tokens(usages[0]))
    if any("completion_tokens_details" in u for u in usages):  # a reasoning model's
        total["completion_tokens_details"] = {"reasoning_tokens": sum(reasoning_tokens(u) for u in usages)}
    return total


@dataclass
class OpenAIRenderer:
    """One chat completion (`chat`) or completion: its identity on every chunk, its choices' logprob formats."""

    identity: Identity
    chat: bool
    logprob_format: Callable[[], LogprobFormat] | None = None  # one format per choice (its text offsets)
    include_usage: bool = False
    usage_so_far: Callable[[], dict[str, Any]] | None = None  # vLLM's continuous_usage_stats

    def __post_init__(self) -> None:
        self._formats: dict[int, LogprobFormat] = {}
        self._usages: dict[int, dict[str, Any]] = {}

    def _logprobs(self, index: int, entries: list[Entry] | None) -> dict[str, Any] | None:
        if entries is None or self.logprob_format is None:
            return None
        if index not in self._formats:
            self._formats[index] = self.logprob_format()
        return self._formats[index].render(entries)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        i = self.identity
        return {"id": i.id, "object": obj, "created": i.created, "model": i.model, "choices": choices}

    def _choice(self, text: str | None, finish_reason: str | None, *, index: int, delta: dict[str, Any] | None = None,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        extra: dict[str, Any] = {}
        if self.include_usage:
            extra = {"usage": self.usage_so_far() if self.usage_so_far is not None else None}
        return sse({**self._envelope(obj, [choice]), **extra})

    def _text(self, index: int, text: str, finish: str | None, entries: list[Entry] | None) -> bytes:
        delta = {"content": text} if text or finish is None else {}
        logprobs = self._logprobs(index, entries)
        return self._chunk(self._choice(text, finish, index=index, delta=delta, logprobs=logprobs))

    # -- a stream -------------------------------------------------------------------------------------

    def opening(self) -> list[bytes]:
        return []

    def part(self, part: Part) -> list[bytes]:
        i = part.choice
        if isinstance(part, Begin):
            if not self.chat:
                return []
            return [self._chunk(self._choice("", None, index=i, delta={"role": "assistant", "content": ""}))]
        if isinstance(part, Reasoning):  # vLLM's `reasoning_content` delta
            return [self._chunk(self._choice(None, None, index=i, delta={"reasoning_content": part.text},
                                             logprobs=self._logprobs(i, part.logprobs)))]
        if isinstance(part, Text):
            return [self._text(i, part.text, None, part.logprobs)]
        if isinstance(part, CallStart | CallArguments):
            entry: dict[str, Any] = {"index": part.index, "function": {"arguments": part.arguments}}
            if isinstance(part, CallStart):
                entry |= {"id": part.call_id, "type": "function",
                          "function": {"name": part.name, "arguments": part.arguments}}
            return [self._chunk(self._choice("", None, index=i, delta={"tool_calls": [entry]}))]
        assert isinstance(part, End)
        self._usages[i] = part.usage
        return [self._text(i, part.text, part.finish_reason, part.logprobs)]

    def closing(self) -> list[bytes]:
        if not self.include_usage:
            return [DONE]
        usage = total_usage([self._usages[k] for k in sorted(self._usages)])
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return [sse({**self._envelope(obj, []), "usage": usage}), DONE]

    def error(self, exc: APIError) -> list[bytes]:
        return [sse(exc.body()), DONE]

    # -- a whole answer -------------------------------------------------------------------------------

    def whole(self, answers: list[Answer]) -> dict[str, Any]:
        choices = [self._whole_choice(a) for a in answers]
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(obj, choices), "usage": total_usage([a.usage for a in answers])}

    def _whole_choice(self, answer: Answer) -> dict[str, Any]:
        i, logprobs = answer.index, self._logprobs(answer.index, answer.logprobs)
        if not self.chat:
            return {**self._choice(answer.text, answer.finish_reason, index=i, logprobs=logprobs),
                    "stop_reason": answer.stop_sequence}
        message: dict[str, Any] = {"role": "assistant", "content": answer.content}
        if answer.calls:
            message["tool_calls"] = [{"id": c.call_id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in answer.calls]
        if answer.reasoning is not None:
            message["reasoning_content"] = answer.reasoning or None
            message["content"] = message["content"] or None  # all reasoning: no answer yet
        choice = {"index": i, "message": message, "logprobs": logprobs, "finish_reason": answer.finish_reason}
        return choice if answer.calls else {**choice, "stop_reason": answer.stop_sequence}


def openai_dialect(tokenizer: Tokenizer, body: OpenAIRequest, *, chat: bool) -> Dialect:
    """A chat completion (`chat`) or a completion, with the request's logprobs and usage options."""
    options = body.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = bool(include_usage and options and options.continuous_usage_stats)

    def renderer(answering: Answering) -> OpenAIRenderer:
        top_n = answering.sampling.logprobs
        logprob_format = None if top_n is None else (lambda: LogprobFormat(
            tokenizer, chat=chat, top_n=top_n, as_ids=body.return_tokens_as_token_ids))
        usage_so_far = None if not continuous else (lambda: usage_dict(
            len(answering.prompt_ids), sum(len(g.output_ids) for g in answering.generations)))
        return OpenAIRenderer(answering.identity, chat, logprob_format, include_usage, usage_so_far)

    return Dialect("chatcmpl" if chat else "cmpl", chat, "messages" if chat else "prompt", renderer)

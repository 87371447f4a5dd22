"""`POST /v1/messages`, Anthropic's Messages API, stateless: served as the chat completion it amounts to, and
answered in the Messages shape (`text` and `tool_use` content blocks), whole or as its event stream.

Claude Code and other agents speak it. The request: `system` (text or text blocks), `messages` whose content
is text or blocks (`text`; `tool_use` in assistant turns; `tool_result` in user turns), `tools` with
`input_schema`, `tool_choice` (`auto`, `any`, `tool` with a `name`, `none`; `disable_parallel_tool_use`),
`max_tokens` (required), `stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`, and `thinking` for a
reasoning model (services.gateway.reasoning): its reasoning comes as a `thinking` block before the answer, and
earlier turns' `thinking` blocks go back to the template as their reasoning. The stream's events
are Anthropic's: `message_start`, `content_block_start`, `content_block_delta` (`thinking_delta`, `text_delta`,
`input_json_delta`: a tool call's input as it is generated), `content_block_stop`, `message_delta` (with
`stop_reason`: `end_turn`, `max_tokens`, `stop_sequence`, `tool_use`), `message_stop`. Usage has
`input_tokens`, `output_tokens`, `cache_read_input_tokens` (the prompt tokens the prefix cache held) and
AFlex's `energy_j`. Errors come in Anthropic's shape (errors.APIError.anthropic_body); `x-api-key` is accepted
where `--api-key` is set (context.check_api_key). `POST /v1/messages/count_tokens` counts a request's input.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import orjson
from pydantic import Field, Strict

from services.gateway.errors import APIError, invalid
from services.gateway.generation import cached_tokens
from services.gateway.openai_schema import Bool, ChatCompletionRequest, _bounds, _Model, chat_completion_of
from services.gateway.parts import Answer, CallArguments, CallStart, End, Part, Reasoning, Text
from services.gateway.streaming import Identity

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessagesRequest(_Model):
    model: str | None = None
    messages: list[dict[str, Any]]
    max_tokens: Annotated[int, Strict(), _bounds("max_tokens")]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Strict(), Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Strict(), _bounds("top_p")] | None = None
    top_k: Annotated[int, Strict(), _bounds("top_k")] | None = None
    stream: Bool = False
    metadata: dict[str, Any] | None = None
    seed: Annotated[int, Strict()] | None = None  # not Anthropic's: reproducible answers, as chat has it
    thinking: dict[str, Any] | None = None  # {"type": "enabled"|"adaptive"|"disabled", "budget_tokens": ...}


class CountTokensRequest(_Model):
    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def _thinking(body: MessagesRequest | CountTokensRequest) -> dict[str, Any] | None:
    """The template switch `thinking` sets: `enable_thinking` on (enabled, adaptive) or off (disabled); left
    out, the template's default. `budget_tokens` is taken as given: `max_tokens` bounds reasoning and answer."""
    if body.thinking is None:
        return None
    kind = body.thinking.get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise invalid("thinking.type must be enabled, adaptive or disabled", "thinking")
    budget = body.thinking.get("budget_tokens")
    if kind == "enabled" and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise invalid("thinking of type enabled needs budget_tokens, a positive integer", "thinking.budget_tokens")
    return {"enable_thinking": kind != "disabled"}


def _text(content: Any, where: str) -> str:
    """Text, or text blocks joined; anything else (an image, a document) is a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where} must be text or a list of content blocks", "messages")
    texts = []
    for k, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise invalid(f"{where}[{k}] of type {kind!r} is not supported here (text blocks only)", "messages")
        texts.append(block["text"])
    return "".join(texts)


def _turns(body: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: an assistant turn's `tool_use` blocks its tool_calls, a user turn's
    `tool_result` blocks `tool` turns (before the user's own text, as they answer the calls before it)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": _text(body.system, "system")}] if body.system else []
    for i, message in enumerate(body.messages):
        role, content, where = message.get("role"), message.get("content"), f"messages[{i}].content"
        if role not in ("user", "assistant"):
            raise invalid(f"messages[{i}].role must be user or assistant, got {role!r}", "messages")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise invalid(f"{where} must be text or a list of content blocks", "messages")
        texts, calls, results, thoughts = [], [], [], []
        for k, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(_text([block], f"{where}[{k}]"))
            elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
                thoughts.append(block["thinking"])  # the turn's reasoning (a template may render it)
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # another server's encrypted reasoning: nothing here can read it
            elif kind == "tool_use" and role == "assistant":
                if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                        and isinstance(block.get("input", {}), dict)):
                    raise invalid(f"{where}[{k}]: a tool_use block needs a string id and name and an object "
                                  "input", "messages")
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise invalid(f"{where}[{k}]: a tool_result block needs the tool_use_id it answers", "messages")
                result = block.get("content", "")
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                "content": _text(result, f"{where}[{k}].content") if result else ""})
            else:
                raise invalid(f"{where}[{k}] of type {kind!r} is not supported in a {role} turn (text, thinking "
                              "and tool_use in assistant turns, tool_result in user turns)", "messages")
        out += results
        if texts or calls:
            out.append({"role": role, "content": "".join(texts) or None, **({"tool_calls": calls} if calls else {}),
                        **({"reasoning_content": "".join(thoughts)} if thoughts else {})})
    return out


def _tools(body: MessagesRequest | CountTokensRequest) -> tuple[list[dict[str, Any]], Any, bool]:
    """(the tools as chat functions, chat's tool_choice, parallel calls allowed)."""
    tools = []
    for k, tool in enumerate(body.tools or []):
        if not isinstance(tool.get("name"), str) or tool.get("type") not in (None, "custom"):
            raise invalid(f"tools[{k}] must be a client tool with a name and an input_schema (server tools, "
                          f"here of type {tool.get('type')!r}, cannot run here)", "tools")
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"},
                    **({"description": tool["description"]} if "description" in tool else {})}
        tools.append({"type": "function", "function": function})
    choice = body.tool_choice or {"type": "auto"}
    kinds: dict[str, Any] = {"auto": "auto", "any": "required", "none": "none"}
    if choice.get("type") == "tool":
        if not isinstance(choice.get("name"), str):
            raise invalid("tool_choice of type tool needs the tool's name", "tool_choice")
        picked: Any = {"type": "function", "function": {"name": choice["name"]}}
    elif choice.get("type") in kinds:
        picked = kinds[choice["type"]]
    else:
        raise invalid("tool_choice.type must be auto, any, tool or none", "tool_choice")
    return tools, (picked if tools else None), not choice.get("disable_parallel_tool_use", False)


def chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion a Messages request amounts to (count_tokens: its prompt only)."""
    tools, choice, parallel = _tools(body)
    fields: dict[str, Any] = {"model": body.model, "messages": _turns(body), "tools": tools or None,
                              "tool_choice": choice, "parallel_tool_calls": parallel,
                              "chat_template_kwargs": _thinking(body)}
    if isinstance(body, MessagesRequest):
        fields |= {"max_completion_tokens": body.max_tokens, "stop": body.stop_sequences, "top_p": body.top_p,
                   "temperature": body.temperature, "top_k": body.top_k, "stream": body.stream, "seed": body.seed}
    return chat_completion_of(fields, "messages", "messages must be a non-empty list")


def usage_of(usage: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's usage: `input_tokens` are the prompt tokens not read from the cache, so a client that adds
    `input_tokens` and `cache_read_input_tokens` (as Anthropic defines them) counts the prompt once."""
    cached = cached_tokens(usage)
    out = {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
           "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}
    if "energy_j" in usage:
        out["energy_j"] = usage["energy_j"]  # AFlex's, as on chat completions
    return out


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as a tool_use block's `input` (empty where they were cut short by `max_tokens`)."""
    try:
        data = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        data = {}
    return data if isinstance(data, dict) else {}


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish: str | None, stop_sequence: str | None) -> str | None:
    if finish is None:
        return None
    return "stop_sequence" if stop_sequence else STOP_REASONS.get(finish, "end_turn")


def _thinking_block(text: str) -> dict[str, Any]:
    """A reasoning model's reasoning; unsigned (`signature` empty): it is the model's own text, not encrypted."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def _event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"


class MessagesRenderer:
    """One Messages answer (one choice): its content blocks whole, or as events: a thinking block while
    reasoning comes, a text block while text comes, a tool_use block per call (its input as JSON pieces),
    each closed when the next opens or the answer ends."""

    def __init__(self, identity: Identity, prompt_tokens: int) -> None:
        self.model, self.prompt_tokens = identity.model, prompt_tokens
        self.id = "msg_" + identity.id.split("-", 1)[-1]
        self._count = 0  # blocks opened
        self._open_kind: str | None = None  # "text" or "thinking" while such a block is open

    def message(self, content: list[dict[str, Any]], finish: str | None, stop_sequence: str | None,
                usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason(finish, stop_sequence), "stop_sequence": stop_sequence, "usage": usage}

    def whole(self, answers: list[Answer]) -> dict[str, Any]:
        answer = answers[0]
        content = [_thinking_block(answer.reasoning)] if answer.reasoning else []
        content += [{"type": "text", "text": answer.content}] if answer.content else []
        content += [{"type": "tool_use", "id": _tool_use_id(c.call_id), "name": c.name, "input": _input(c.arguments)}
                    for c in answer.calls]
        stop_sequence = None if answer.calls else answer.stop_sequence
        return self.message(content, answer.finish_reason, stop_sequence, usage_of(answer.usage))

    def opening(self) -> list[bytes]:
        usage = usage_of({"prompt_tokens": self.prompt_tokens, "completion_tokens": 0})
        return [_event("message_start", message=self.message([], None, None, usage))]

    def part(self, part: Part) -> list[bytes]:
        if isinstance(part, Reasoning):
            return self._text(part.text, "thinking")
        if isinstance(part, Text):
            return self._text(part.text)
        if isinstance(part, CallStart):
            start = {"type": "tool_use", "id": _tool_use_id(part.call_id), "name": part.name, "input": {}}
            out = self._close()
            self._count += 1
            out.append(_event("content_block_start", index=self._count - 1, content_block=start))
            return out + self._arguments(part.arguments)
        if isinstance(part, CallArguments):
            return self._arguments(part.arguments)
        if isinstance(part, End):
            usage = usage_of(part.usage or {"prompt_tokens": self.prompt_tokens, "completion_tokens": 0})
            delta = {"stop_reason": stop_reason(part.finish_reason, part.stop_sequence),
                     "stop_sequence": part.stop_sequence}
            return [*self._text(part.text), *self._close(), _event("message_delta", delta=delta, usage=usage),
                    _event("message_stop")]
        return []

    def closing(self) -> list[bytes]:
        return []

    def error(self, exc: APIError) -> list[bytes]:
        return [_event("error", error=exc.anthropic_body()["error"])]

    def _text(self, text: str, kind: str = "text") -> list[bytes]:
        if not text:
            return []
        out = []
        if self._open_kind != kind:
            out += self._close()
            self._open_kind, self._count = kind, self._count + 1
            start = _thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
            out.append(_event("content_block_start", index=self._count - 1, content_block=start))
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
            {"type": "text_delta", "text": text}
        return [*out, _event("content_block_delta", index=self._count - 1, delta=delta)]

    def _arguments(self, arguments: str) -> list[bytes]:
        if not arguments:
            return []
        return [_event("content_block_delta", index=self._count - 1,
                       delta={"type": "input_json_delta", "partial_json": arguments})]

    def _close(self) -> list[bytes]:
        """The open block's end (none before the first)."""
        self._open_kind = None
        return [_event("content_block_stop", index=self._count - 1)] if self._count else []

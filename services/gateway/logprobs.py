"""The `logprobs` objects of OpenAI responses, from the token ids and `TokenLogprob`s the mesh sends.

Chat (`logprobs: true`, `top_logprobs: n`): `{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}`. Completions (`logprobs: n`): the legacy
parallel lists `tokens`, `token_logprobs`, `top_logprobs` (a token -> logprob map of the n best and, as
vLLM has it, the sampled token) and `text_offset`; with `echo` the prompt's tokens come first, the
very first with null logprobs. A token's text is the token decoded alone (vLLM's rule; a token that
holds part of a character reads as U+FFFD), or with vLLM's `return_tokens_as_token_ids` "token_id:<id>".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shared.messages import TokenLogprob
from shared.model.tokenizer import Tokenizer

Entry = tuple[int, TokenLogprob | None]  # a token id and its logprob (None: the prompt's first token)


class LogprobFormat:
    """Renders one response's logprobs, chunk by chunk (text offsets run on across chunks)."""

    def __init__(self, tokenizer: Tokenizer, *, chat: bool, top_n: int, as_ids: bool = False) -> None:
        self.tokenizer, self.chat, self.top_n, self.as_ids = tokenizer, chat, top_n, as_ids
        self._texts: dict[int, str] = {}
        self._offset = 0  # completions: where the next token's text starts in the returned text

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = (f"token_id:{token_id}" if self.as_ids
                    else self.tokenizer.decode([token_id], skip_special_tokens=False))
            self._texts[token_id] = text
        return text

    def render(self, entries: Sequence[Entry]) -> dict[str, Any]:
        return self._chat(entries) if self.chat else self._completion(entries)

    def _chat(self, entries: Sequence[Entry]) -> dict[str, Any]:
        content = []
        for token_id, entry in entries:
            if entry is None:
                continue
            top = [self._chat_token(t, lp) for t, lp in zip(entry.top_ids[:self.top_n],
                                                               entry.top_logprobs[:self.top_n], strict=True)]
            content.append({**self._chat_token(token_id, entry.logprob), "top_logprobs": top})
        return {"content": content}

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _completion(self, entries: Sequence[Entry]) -> dict[str, Any]:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, entry in entries:
            text = self.token_text(token_id)
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(entry.logprob)
            best = {self.token_text(t): lp for t, lp in zip(entry.top_ids[:self.top_n],
                                                            entry.top_logprobs[:self.top_n], strict=True)}
            best.setdefault(text, entry.logprob)
            top_logprobs.append(best)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}


def prompt_entries(prompt_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None] | None) -> list[Entry]:
    """An echoed prompt's entries: its tokens with their logprobs (all None where none came)."""
    if logprobs is None or len(logprobs) != len(prompt_ids):
        return [(t, None) for t in prompt_ids]
    return list(zip(prompt_ids, logprobs, strict=True))

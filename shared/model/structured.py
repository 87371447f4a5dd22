"""Structured outputs: a `response_format` as an llguidance grammar, and the matcher that masks sampling.

The gateway turns `{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"schema": ...}}`
into a grammar and checks it (a bad schema is a 400 before anything runs); the grammar travels in the
sampling parameters, and the attention worker, where sampling happens, keeps one `Constraint` per
sequence: before each draw, tokens the grammar cannot take next get -inf; each sampled token advances it.

Why llguidance (MIT): one abi3 CPU wheel with no compiler and no torch (the gateway needs it too), JSON
Schema compiled natively and lazily, so a schema costs nothing up front, and a mask in microseconds on
SmolLM2's 49,152-token vocabulary (benchmarks/structured_outputs.py). xgrammar (Apache-2.0) compiles
a grammar ahead for the vocabulary; outlines-core builds a whole index per schema before the first token.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import llguidance

from shared.errors import InvalidRequestError
from shared.model.tokenizer import Tokenizer

# JSON as json.dumps writes it: ", " and ": ", no other whitespace. With flexible whitespace a model may
# pad forever (a small one does) and never close the object within max_tokens.
JSON_LAYOUT: Any = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}

_tokenizers: dict[tuple[int, int], llguidance.LLTokenizer] = {}
_lock = threading.Lock()


def grammar_for(kind: str, schema: dict[str, Any] | None = None) -> str | None:
    """The grammar of an OpenAI `response_format` of type `kind` (None for plain text): `json_lark`'s, the one
    construction the gateway uses too."""
    lark = json_lark(kind, schema)
    return None if lark is None else str(llguidance.LLMatcher.grammar_from_lark(lark))


def json_lark(kind: str, schema: dict[str, Any] | None = None, rule: str = "start") -> str | None:
    """`grammar_for` as lark text, the JSON in rule `rule` (for a grammar that puts something before it)."""
    checked = _schema_of(kind, schema)
    if checked is None:
        return None
    return f"{rule}: %json {json.dumps({**checked, 'x-guidance': JSON_LAYOUT})}\n"


def _schema_of(kind: str, schema: dict[str, Any] | None) -> dict[str, Any] | None:
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        if not isinstance(schema, dict):
            raise InvalidRequestError("response_format.json_schema.schema must be a JSON Schema object",
                                      "response_format")
        return schema
    raise InvalidRequestError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                              "response_format")


def llg_tokenizer(tokenizer: Tokenizer, n_vocab: int) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary (built once per tokenizer: ~0.2 s for SmolLM2's)."""
    key = (id(tokenizer), n_vocab)
    with _lock:
        if key not in _tokenizers:
            eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
            _tokenizers[key] = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=n_vocab, eos_token=eos)
        return _tokenizers[key]


def check(grammar: str, tokenizer: llguidance.LLTokenizer, param: str = "response_format") -> None:
    """Raise `InvalidRequestError` (naming `param`, what the grammar came from) when it cannot be built."""
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error and not error.startswith("WARNING"):
        raise InvalidRequestError(f"{param}: {error}", param)


class Constraint:
    """One sequence's place in its grammar: which tokens may come next, advanced token by token."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise InvalidRequestError(f"response_format: {self._matcher.get_error()}", "response_format")

    def fill_mask(self, pointer: int, n_bytes: int) -> None:
        """The allowed next tokens, one bit each (32 per int32 word), written at `pointer`."""
        self._matcher.unsafe_compute_mask_ptr(pointer, n_bytes)

    def consume(self, token_id: int) -> None:
        """Advance past a sampled (or already generated) token. A token outside the grammar (a
        continuation from before the constraint) stops constraining rather than failing the request."""
        self._matcher.consume_token(token_id)

    @property
    def failed(self) -> bool:
        return self._matcher.is_error()

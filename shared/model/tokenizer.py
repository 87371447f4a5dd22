"""Text in and out of token ids: a `tokenizers` tokenizer plus the model's chat template.

The serving path needs three things from a tokenizer and nothing more of transformers: encode a
rendered prompt, render a conversation with the checkpoint's own Jinja chat template, and turn
generated ids back into text one token at a time. A checkpoint brings its tokenizer either as an HF
`tokenizer.json` + `tokenizer_config.json` or inside a GGUF file's metadata, from which a
`tokenizers` BPE is rebuilt to tokenize exactly as llama.cpp does.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from shared.errors import InvalidRequestError, TokenizerError

if TYPE_CHECKING:
    from shared.model.gguf_file import GGUFCheckpoint

# llama.cpp token types (`tokenizer.ggml.token_type`).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Split regexes of llama.cpp's pre-tokenizer types (llama-vocab.cpp), as HF tokenizers spell them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = ("default", "gpt2", "gpt-2", "olmo", "jais", "poro-chat", "viking", "bloom", "gpt3-finnish")
_DIGITS_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
_LLAMA3_PRE = ("llama3", "llama-bpe", "llama-v3", "smaug-bpe", "falcon3", "dbrx")
_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen", "megrez")
SUPPORTED_GGUF_PRE_TOKENIZERS = _GPT2_PRE + _DIGITS_THEN_GPT2_PRE + _LLAMA3_PRE + _QWEN2_PRE


class Tokenizer:
    """Encode, decode and render chat templates for one checkpoint."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
        add_bos_token: bool = False,
        source: str = "<tokenizer>",
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.add_bos_token = add_bos_token
        self.source = source
        self.bos_token_id = self._id_of(bos_token)
        self.pad_token_id = self._id_of(pad_token)
        eos_ids = [self._id_of(eos_token), *extra_eos_token_ids]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos_ids if i is not None))
        self._compiled: jinja2.Template | None = None

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, added tokens included (may be below the model's padded vocab)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, directory: str | Path) -> Tokenizer | None:
        """From an HF model directory; None when it has no `tokenizer.json`."""
        directory = Path(directory)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            return None
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerError(f"cannot load {tokenizer_file}: {exc}") from None
        config = _read_json(directory / "tokenizer_config.json")
        special_map = _read_json(directory / "special_tokens_map.json")
        generation = _read_json(directory / "generation_config.json")

        def token(name: str) -> str | None:
            return _token_content(config.get(name)) or _token_content(special_map.get(name))

        extra_eos = generation.get("eos_token_id")  # instruct models often stop on several ids
        extra_eos_ids = extra_eos if isinstance(extra_eos, list) else [] if extra_eos is None else [extra_eos]
        return cls(
            backend,
            chat_template=_hf_chat_template(directory, config),
            bos_token=token("bos_token"),
            eos_token=token("eos_token"),
            pad_token=token("pad_token"),
            unk_token=token("unk_token"),
            extra_eos_token_ids=tuple(int(i) for i in extra_eos_ids),
            add_bos_token=bool(config.get("add_bos_token", False)),
            source=str(directory),
        )

    @classmethod
    def from_gguf(cls, checkpoint: GGUFCheckpoint) -> Tokenizer | None:
        """From a GGUF file's `tokenizer.ggml.*` metadata; None when the file carries no tokenizer."""
        model = checkpoint.metadata("tokenizer.ggml.model")
        if model is None:
            return None
        if model != "gpt2":
            raise TokenizerError(f"GGUF tokenizer model {model!r} in {checkpoint.source} is not supported "
                                 "(supported: gpt2, i.e. byte-level BPE); serve an HF tokenizer directory")
        tokens: list[str] = checkpoint.metadata("tokenizer.ggml.tokens") or []
        merges: list[str] = checkpoint.metadata("tokenizer.ggml.merges") or []
        token_types: list[int] = checkpoint.metadata("tokenizer.ggml.token_type") or []
        pre = checkpoint.metadata("tokenizer.ggml.pre", "default")
        if not tokens:
            raise TokenizerError(f"{checkpoint.source}: tokenizer.ggml.tokens is empty")
        backend = _byte_level_bpe(tokens, merges, token_types, pre, checkpoint.source)

        def token(key: str) -> str | None:
            index = checkpoint.metadata(f"tokenizer.ggml.{key}")
            return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

        extra_eos = tuple(
            int(index) for key in ("eot_token_id", "eom_token_id")
            if (index := checkpoint.metadata(f"tokenizer.ggml.{key}")) is not None
        )
        return cls(
            backend,
            chat_template=checkpoint.metadata("tokenizer.chat_template"),
            bos_token=token("bos_token_id"),
            eos_token=token("eos_token_id"),
            pad_token=token("padding_token_id"),
            unk_token=token("unknown_token_id"),
            extra_eos_token_ids=extra_eos,
            add_bos_token=bool(checkpoint.metadata("tokenizer.ggml.add_bos_token", False)),
            source=checkpoint.source,
        )

    # --- text <-> ids ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text are always matched whole;
        `add_special_tokens` adds the BOS the checkpoint asks for (a rendered chat prompt usually has it)."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # --- chat -----------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a conversation as the prompt text the model was trained on, as transformers does.

        Extra keyword arguments (`tools`, `documents`, `enable_thinking`, ...) reach the template.
        A template that rejects the conversation (`raise_exception`) raises `InvalidRequestError`.
        """
        template = self._template()
        variables: dict[str, Any] = {"tools": None, "documents": None}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            if getattr(self, name) is not None:
                variables[name] = getattr(self, name)
        variables.update(_plain(kwargs))
        try:
            return template.render(
                messages=_plain(messages), add_generation_prompt=add_generation_prompt, **variables
            )
        except _TemplateRejection as exc:
            raise InvalidRequestError(f"chat template rejected the conversation: {exc}", "messages") from None
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template of {self.source} failed: {exc}") from None

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template reads a `tools` variable (renders offered functions itself)."""
        if not self.chat_template:
            return False
        try:
            return "tools" in jinja2.meta.find_undeclared_variables(_jinja_environment().parse(self.chat_template))
        except jinja2.TemplateError:
            return False

    def _template(self) -> jinja2.Template:
        if self._compiled is None:
            if not self.chat_template:
                raise TokenizerError(f"{self.source} has no chat template; send a plain prompt "
                                     "(completions) or serve a checkpoint that ships one")
            try:
                self._compiled = _jinja_environment().from_string(self.chat_template)
            except jinja2.TemplateError as exc:
                raise TokenizerError(f"chat template of {self.source} does not compile: {exc}") from None
        return self._compiled


class IncrementalDetokenizer:
    """Turn generated ids into text deltas that never split a character.

    Decoding one token alone is wrong for byte-level and sentencepiece vocabularies: a character can
    span tokens, and decoders drop or add leading spaces at a sequence start. Like vLLM and TGI, we
    decode a short window (`prefix_offset`..end) twice, with and without the new tokens, and emit the
    difference only once it no longer ends in an incomplete character (U+FFFD).
    """

    _PROMPT_WINDOW_TOKENS = 5  # context from the prompt so the first delta decodes in place

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids or [])
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - self._PROMPT_WINDOW_TOKENS, 0)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text that became stable (often "")."""
        self._ids.append(int(token_id))
        return self._delta(final=False)

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character decodes as U+FFFD)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], self._skip_special)
        new_text = decode(self._ids[self._prefix_offset:], self._skip_special)
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]


# --- GGUF -> tokenizers ---------------------------------------------------------------------------


def _byte_level_bpe(tokens: list[str], merges: list[str], token_types: list[int], pre: str,
                    source: str) -> BackendTokenizer:
    """A byte-level BPE equivalent to llama.cpp's for this vocabulary and pre-tokenizer type."""
    vocab: dict[str, int] = {}
    for index, text in enumerate(tokens):
        vocab.setdefault(text, index)  # duplicates (padding tokens) keep their first id
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise TokenizerError(f"{source}: malformed merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((parts[0], parts[1]))
    # llama3 vocabularies take a pre-token that is itself a token whole, as llama.cpp and HF do.
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=pre in _LLAMA3_PRE)
    backend = BackendTokenizer(bpe)
    if pre in _GPT2_PRE:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in _DIGITS_THEN_GPT2_PRE:  # llama.cpp splits every digit off first, then the GPT-2 regex
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        if pre in _QWEN2_PRE:
            backend.normalizer = normalizers.NFC()  # as Qwen2's own tokenizer.json
    else:
        raise TokenizerError(f"{source}: GGUF pre-tokenizer {pre!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_GGUF_PRE_TOKENIZERS)})")
    backend.decoder = decoders.ByteLevel()
    # Control and user-defined tokens are matched whole in the text, as llama.cpp does; only control
    # tokens are special (skipped when decoding with skip_special_tokens).
    byte_alphabet = set(_byte_level_alphabet())
    special: list[AddedToken] = []
    user_defined: list[AddedToken] = []
    for text, kind in zip(tokens, token_types, strict=False):
        if kind == _TOKEN_CONTROL and set(text) <= byte_alphabet:
            special.append(AddedToken(text, special=True, normalized=False))
        elif kind == _TOKEN_USER_DEFINED:
            user_defined.append(AddedToken(text, special=False, normalized=False))
    backend.add_special_tokens(special)
    backend.add_tokens(user_defined)
    return backend


def _byte_level_alphabet() -> list[str]:
    """The 256 printable characters GPT-2's byte-level BPE spells bytes with."""
    return pre_tokenizers.ByteLevel.alphabet()


# --- HF files -------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _hf_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """The default chat template: `chat_template.jinja` (transformers >= 4.43 saves it there),
    else tokenizer_config.json's `chat_template` (a string, or a list of named templates)."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None:
        template = _read_json(directory / "chat_template.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


# --- Jinja ----------------------------------------------------------------------------------------


class _TemplateRejection(jinja2.TemplateError):
    """`raise_exception(...)` called by a template: the conversation, not the template, is at fault."""


def _raise_exception(message: str) -> None:
    raise _TemplateRejection(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' tojson: Jinja's own escapes HTML characters, which templates must not."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (assistant-mask markers) and render the body."""

    tags = {"generation"}  # noqa: RUF012 - jinja declares it a plain set attribute on Extension

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _jinja_environment() -> ImmutableSandboxedEnvironment:
    """Sandboxed like transformers: templates come with checkpoints and are untrusted code."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types, so no object with risky methods reaches Jinja."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if hasattr(value, "model_dump"):  # pydantic models
        return _plain(value.model_dump())
    return str(value)

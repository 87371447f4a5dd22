"""Tokenizer and IncrementalDetokenizer against transformers (and llama.cpp) on SmolLM2's GGUF vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from tokenizers import pre_tokenizers

from shared.errors import InvalidRequestError, TokenizerError
from shared.model.gguf_file import GGUFCheckpoint
from shared.model.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.conftest import TEST_DATA

TEXTS = [
    "Hello world",
    " leading space and trailing   ",
    "I'm sure they'll say we've won't",
    "naïve café Ελληνικά русский 日本語 中文 한국어",
    "emoji 🤗🚀 family 👨‍👩‍👧 flag 🇫🇷",
    "def f(x):\n    return {'a': x ** 2}  # comment\n\n\tindent\r\n",
    "numbers 3.14159 and 2024-01-01, x=12345",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "special glued<|endoftext|>text<repo_name>x",
    "",
    "\u200b zero width, \u00a0nbsp, combining e\u0301",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello! 🤗"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "日本語で？"},
    ],
]


@pytest.fixture(scope="module")
def ours(smollm2_path: Path) -> Tokenizer:
    tokenizer = Tokenizer.from_gguf(GGUFCheckpoint(smollm2_path))
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="module")
def theirs(smollm2_hf_tokenizer):
    return smollm2_hf_tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours: Tokenizer, theirs, text: str) -> None:
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_and_ids(ours: Tokenizer, theirs) -> None:
    assert ours.encode("<|im_start|><|im_end|><|endoftext|>") == [1, 2, 0]
    for name in ("bos_token", "eos_token", "pad_token"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert (ours.bos_token_id, ours.eos_token_ids, ours.vocab_size) == (1, (2,), 49152)
    assert ours.add_bos_token is False  # SmolLM2 puts no BOS: the chat template starts with <|im_start|>
    assert ours.encode("hi", add_special_tokens=True) == theirs.encode("hi", add_special_tokens=True)


def test_digits_split_as_llama_cpp_does(ours: Tokenizer) -> None:
    """GGUF pre-tokenizer "smollm" splits digits off first (like SmolLM2's own tokenizer.json).

    transformers' GGUF loader ignores the pre-tokenizer type and so merges "  " differently before a
    digit; llama.cpp, the reference for a GGUF file, gives [a, "ĠĠ", 1, 2].
    """
    assert ours.encode("a  12") == [81, 256, 33, 34]


LLAMA_CPP_TOKENS = TEST_DATA / "llama_cpp_smollm2_tokens.json"  # llama.cpp's ids, recorded with its source


def llama_cpp_texts() -> list[str]:
    return [t for t in [*TEXTS, "a  12", "x 12345 y", "  42\n\n 7"] if t]


def test_encode_matches_llama_cpp(ours: Tokenizer) -> None:
    """llama.cpp is the reference for a GGUF file. AFlex does not install llama-cpp-python (it compiles
    llama.cpp), so its ids for these texts are recorded in tests/data with the call that made them."""
    recorded = json.loads(LLAMA_CPP_TOKENS.read_text(encoding="utf-8"))
    assert "llama-cpp-python" in recorded["source"] and set(recorded["tokens"]) == set(llama_cpp_texts())
    for text, ids in recorded["tokens"].items():
        assert ours.encode(text) == ids, text


def record_llama_cpp_tokens() -> None:
    """Write LLAMA_CPP_TOKENS again (needs `pip install llama-cpp-python`)."""
    import llama_cpp

    from shared.model.checkpoint import default_model_path

    vocab = llama_cpp.Llama(str(default_model_path()), vocab_only=True, verbose=False)
    source = (f"llama-cpp-python {llama_cpp.__version__}: Llama(SmolLM2-135M-Instruct.Q4_1.gguf, vocab_only=True)"
              ".tokenize(text.encode(), add_bos=False, special=True); regenerate with `python -m "
              "tests.shared.model.test_tokenizer` where llama-cpp-python is installed")
    tokens = {t: vocab.tokenize(t.encode(), add_bos=False, special=True) for t in llama_cpp_texts()}
    LLAMA_CPP_TOKENS.write_text(json.dumps({"source": source, "tokens": tokens}, ensure_ascii=False, indent=1),
                                encoding="utf-8")


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours: Tokenizer, theirs, messages, add_generation_prompt) -> None:
    prompt = add_generation_prompt
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=prompt) == expected


def test_from_hf_dir_round_trips_transformers_save(ours: Tokenizer, theirs, tmp_path: Path) -> None:
    theirs.save_pretrained(tmp_path)
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded is not None
    for text in TEXTS:
        assert loaded.encode(text) == theirs.encode(text, add_special_tokens=False)
        ids = theirs.encode(text)
        assert loaded.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    for messages in CONVERSATIONS:
        assert loaded.apply_chat_template(messages) == ours.apply_chat_template(messages)
    assert (loaded.bos_token_id, loaded.eos_token_ids, loaded.pad_token_id) == (1, (2,), 2)
    assert loaded.vocab_size == ours.vocab_size


def test_from_hf_dir_reads_config_template_list_and_generation_eos(ours: Tokenizer, tmp_path: Path) -> None:
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "add_bos_token": True,
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "{{ bos_token }}"
                                            "{% for m in messages %}{{ m.content }}{% endfor %}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded is not None
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"
    assert loaded.eos_token_ids == (2, 0)
    assert loaded.encode("hi", add_special_tokens=True) == [1, *ours.encode("hi")]
    assert loaded.encode("<|im_start|>hi", add_special_tokens=True) == [1, *ours.encode("hi")]  # one BOS
    assert Tokenizer.from_hf_dir(tmp_path / "nothing-here") is None


# --- chat template rendering ----------------------------------------------------------------------


def make(template: str | None, ours: Tokenizer) -> Tokenizer:
    return Tokenizer(ours.backend, chat_template=template, bos_token="<s>", eos_token="<|im_end|>")


def test_template_environment_like_transformers(ours: Tokenizer) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}{{ eos_token }}"
        "{% if tools %}{{ tools | tojson(indent=1) }}{% endif %}{{ strftime_now('%Y') | length }}"
    )
    rendered = make(template, ours).apply_chat_template(
        [{"role": "skip", "content": "no"}, {"role": "user", "content": "é <b>"}], tools=[{"name": "f"}]
    )
    assert rendered == '<s>{"role": "user", "content": "é <b>"}<|im_end|>[\n {\n  "name": "f"\n }\n]4'


def test_template_trims_blocks(ours: Tokenizer) -> None:
    template = ("{% for m in messages %}\n    {{ m.content }}\n{% endfor %}\n"
                "{% if add_generation_prompt %}GO{% endif %}")
    assert make(template, ours).apply_chat_template([{"role": "user", "content": "a"}]) == "    a\nGO"


def test_template_rejection_is_an_invalid_request(ours: Tokenizer) -> None:
    template = ("{% if messages[0].role != 'user' %}"
                "{{ raise_exception('first message must be user') }}{% endif %}")
    with pytest.raises(InvalidRequestError, match="first message must be user"):
        make(template, ours).apply_chat_template([{"role": "assistant", "content": "x"}])


def test_missing_or_broken_template_is_a_tokenizer_error(ours: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="no chat template"):
        make(None, ours).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(TokenizerError, match="does not compile"):
        make("{% for %}", ours).apply_chat_template([{"role": "user", "content": "x"}])


def test_template_sandbox_blocks_attribute_escapes(ours: Tokenizer) -> None:
    template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(TokenizerError):
        make(template, ours).apply_chat_template([])


# --- incremental detokenization -------------------------------------------------------------------


@pytest.mark.parametrize("text", [t for t in TEXTS if t] + ["🤗" * 5, "你好世界" * 3, "e\u0301\u0301 ok"])
def test_incremental_detokenizer_concatenates_to_decode(ours: Tokenizer, text: str) -> None:
    ids = ours.encode(text)
    detokenizer = IncrementalDetokenizer(ours)
    deltas = [detokenizer.push(i) for i in ids]
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == ours.decode(ids)
    assert not any("\ufffd" in delta for delta in deltas)


def test_incremental_detokenizer_holds_back_partial_characters(ours: Tokenizer) -> None:
    ids = ours.encode("🤗")
    assert len(ids) > 1  # the emoji's bytes span tokens
    detokenizer = IncrementalDetokenizer(ours)
    assert [detokenizer.push(i) for i in ids] == [""] * (len(ids) - 1) + ["🤗"]
    assert detokenizer.flush() == ""


def test_incremental_detokenizer_after_prompt_and_specials(ours: Tokenizer) -> None:
    prompt = ours.apply_chat_template([{"role": "user", "content": "hi"}])
    prompt_ids = ours.encode(prompt)
    generated = ours.encode("Voilà 🚀 日本<|im_end|>")
    detokenizer = IncrementalDetokenizer(ours, prompt_ids=prompt_ids)
    text = "".join(detokenizer.push(i) for i in generated) + detokenizer.flush()
    assert text == "Voilà 🚀 日本"
    kept = IncrementalDetokenizer(ours, prompt_ids=prompt_ids, skip_special_tokens=False)
    assert "".join(kept.push(i) for i in generated) + kept.flush() == "Voilà 🚀 日本<|im_end|>"


def test_incremental_detokenizer_flushes_an_incomplete_tail(ours: Tokenizer) -> None:
    ids = ours.encode("ok 🤗")
    detokenizer = IncrementalDetokenizer(ours)
    streamed = "".join(detokenizer.push(i) for i in ids[:-1])
    assert streamed == "ok"
    assert detokenizer.flush() == ours.decode(ids[:-1])[len(streamed):]  # the held-back bytes, as U+FFFD


# --- GGUF tokenizer metadata written here ---------------------------------------------------------


def write_vocab(path: Path, *, model: str = "gpt2", pre: str = "gpt2",
                with_tokenizer: bool = True) -> list[str]:
    """A byte-level vocabulary: the 256 byte symbols, a few merges, control and user-defined tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merged = ["he", "hel", "hell", "hello", "12", "123"]
    tokens = ["<s>", "</s>", "<|eot|>", "<think>", *alphabet, *merged]
    types = [3, 3, 3, 4] + [1] * (len(alphabet) + len(merged))
    writer = gguf.GGUFWriter(path, "llama")
    if with_tokenizer:
        writer.add_tokenizer_model(model)
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(["h e", "he l", "hel l", "hell o", "1 2", "12 3"])
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)
        writer.add_eot_token_id(2)
        writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokens


def test_gguf_control_and_user_defined_tokens(tmp_path: Path) -> None:
    tokens = write_vocab(tmp_path / "vocab.gguf")
    tokenizer = Tokenizer.from_gguf(GGUFCheckpoint(tmp_path / "vocab.gguf"))
    assert tokenizer is not None
    hello, think, eos = tokens.index("hello"), tokens.index("<think>"), tokens.index("</s>")
    ids = tokenizer.encode("hello<think>hello</s>")
    assert ids == [hello, think, hello, eos]
    assert tokenizer.decode(ids) == "hello<think>hello"  # user-defined tokens are text, control ones are not
    assert tokenizer.decode(ids, skip_special_tokens=False) == "hello<think>hello</s>"
    assert tokenizer.encode("hello", add_special_tokens=True) == [0, hello]
    assert tokenizer.encode("<s>hello", add_special_tokens=True) == [0, hello]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids) == (0, (1, 2))
    with pytest.raises(TokenizerError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("gpt2", ["x", "Ġ12345", "Ġab"]),
        ("smollm", ["x", "Ġ", "1", "2", "3", "4", "5", "Ġab"]),
        ("llama-bpe", ["x", "Ġ", "123", "45", "Ġab"]),
        ("qwen2", ["x", "Ġ", "1", "2", "3", "4", "5", "Ġab"]),
    ],
)
def test_gguf_pre_tokenizer_types(tmp_path: Path, pre: str, pieces: list[str]) -> None:
    write_vocab(tmp_path / "vocab.gguf", pre=pre)
    tokenizer = Tokenizer.from_gguf(GGUFCheckpoint(tmp_path / "vocab.gguf"))
    assert tokenizer is not None
    assert [piece for piece, _ in tokenizer.backend.pre_tokenizer.pre_tokenize_str("x 12345 ab")] == pieces


def test_gguf_without_or_with_unsupported_tokenizer(tmp_path: Path) -> None:
    write_vocab(tmp_path / "none.gguf", with_tokenizer=False)
    assert Tokenizer.from_gguf(GGUFCheckpoint(tmp_path / "none.gguf")) is None
    write_vocab(tmp_path / "pre.gguf", pre="mystery-pre")
    with pytest.raises(TokenizerError, match="mystery-pre"):
        Tokenizer.from_gguf(GGUFCheckpoint(tmp_path / "pre.gguf"))
    write_vocab(tmp_path / "spm.gguf", model="t5")
    with pytest.raises(TokenizerError, match="'t5'"):
        Tokenizer.from_gguf(GGUFCheckpoint(tmp_path / "spm.gguf"))


if __name__ == "__main__":
    record_llama_cpp_tokens()

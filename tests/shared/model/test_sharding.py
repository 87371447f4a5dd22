"""A half split over a group's ranks (tensor and expert parallel) computes what the whole half computes.

The ranks are threads here, each with its own gloo group over one store, as the processes of a worker
group are (tests/services/test_worker_groups.py starts those for real). The sums come in another order
than one device's, so outputs agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.model.attention import AttentionHalf, AttentionMeta, PagedKVStore, SequencePass
from shared.model.checkpoint import open_checkpoint
from shared.model.ffn import FFNHalf
from shared.model.sharding import Sharding, ShardingError, attention_args, ffn_args
from shared.model.weights import load_attention_half, load_ffn_half
from shared.transport.device_group import DeviceGroup, GroupError

CPU = torch.device("cpu")


def run_ranks(size: int, work: Callable[[DeviceGroup], Any], timeout_s: float = 20.0) -> list[Any]:
    """`work(group)` on each rank of a fresh group of `size` threads; their results by rank."""
    store, address = DeviceGroup.open_store(advertise="127.0.0.1")
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            group = (DeviceGroup(store, 0, size, CPU, timeout_s, address) if r == 0
                     else DeviceGroup.join(address, r, size, CPU, timeout_s))
            results[r] = work(group)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize(("arch", "tp", "ep"), [("llama", 2, 1), ("qwen3", 2, 1), ("mixtral", 2, 1),
                                                 ("mixtral", 1, 2), ("qwen3_moe", 1, 2), ("qwen3_moe", 2, 2)])
def test_ffn_group_sums_to_the_whole_half(tiny_checkpoints: dict[str, Path], arch: str, tp: int, ep: int) -> None:
    checkpoint = open_checkpoint(str(tiny_checkpoints[arch]))
    args = checkpoint.args
    whole = load_ffn_half(args, checkpoint.tensors)
    torch.manual_seed(0)
    x = torch.randn(7, args.dim)  # [T, D]

    def shard(group: DeviceGroup) -> list[torch.Tensor]:
        half = load_ffn_half(args, checkpoint.tensors, sharding=Sharding(group.rank, tp, ep))
        assert isinstance(half, FFNHalf)
        half.reduce = group.all_reduce
        with torch.inference_mode():
            return [half(layer, x.clone()) for layer in range(args.n_layers)]

    outputs = run_ranks(tp * ep, shard)
    with torch.inference_mode():
        for layer in range(args.n_layers):
            expected = whole(layer, x)
            for rank_out in outputs:  # every rank ends with the same total
                torch.testing.assert_close(rank_out[layer], expected, rtol=1e-5, atol=1e-5)
            assert torch.equal(outputs[0][layer], outputs[-1][layer])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3's one KV head is replicated on both ranks
def test_attention_group_sums_to_the_whole_half(tiny_checkpoints: dict[str, Path], arch: str) -> None:
    checkpoint = open_checkpoint(str(tiny_checkpoints[arch]))
    args = checkpoint.args
    block_slots = 64
    passes = [SequencePass(0, 5, list(range(5))), SequencePass(3, 1, list(range(16, 20)))]
    tokens = torch.tensor([5, 9, 11, 3, 7, 42])

    def run(half: Any) -> tuple[torch.Tensor, torch.Tensor]:
        kv = PagedKVStore(half.args, block_slots, torch.float32, CPU)
        with torch.inference_mode():
            meta = AttentionMeta.build(passes, CPU)
            meta.kernels = None  # the same attention path on both sides
            residual, rope = half.embed(tokens), half.rope(meta.positions)
            ffn_out = None
            for layer in range(args.n_layers):
                residual, ffn_in = half.attend(layer, residual, ffn_out, rope, meta, kv)
                ffn_out = ffn_in * 0.5  # any FFN: the same on both sides
        return residual, ffn_in

    expected = run(load_attention_half(args, checkpoint.tensors))

    def shard(group: DeviceGroup) -> tuple[torch.Tensor, torch.Tensor]:
        half = load_attention_half(args, checkpoint.tensors, sharding=Sharding(group.rank, 2))
        assert isinstance(half, AttentionHalf)
        assert half.args.n_heads == args.n_heads // 2
        half.reduce = group.all_reduce
        return run(half)

    for residual, ffn_in in run_ranks(2, shard):
        torch.testing.assert_close(residual, expected[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ffn_in, expected[1], rtol=1e-5, atol=1e-5)


def test_a_group_the_model_does_not_divide_is_refused(tiny_checkpoints: dict[str, Path]) -> None:
    llama = open_checkpoint(str(tiny_checkpoints["llama"])).args  # 4 heads, 2 KV heads, FFN width 160
    with pytest.raises(ShardingError, match=r"query heads \(4\) does not split over 3 ranks"):
        attention_args(llama, Sharding(0, 3))
    wide = replace(llama, n_heads=48, n_kv_heads=6)  # a rank's 12 query heads would read two KV heads unevenly
    with pytest.raises(ShardingError, match=r"KV heads \(6\) do not split over 4 ranks"):
        attention_args(wide, Sharding(0, 4))
    with pytest.raises(ShardingError, match="needs a mixture-of-experts model"):
        ffn_args(llama, Sharding(0, 1, 2))
    mixtral = open_checkpoint(str(tiny_checkpoints["mixtral"])).args  # 4 experts
    with pytest.raises(ShardingError, match=r"experts \(4\) does not split over 3 ranks"):
        ffn_args(mixtral, Sharding(0, 1, 3))
    with pytest.raises(ShardingError, match="rank 2 is not in a group of 2"):
        Sharding(2, 2)


def test_a_rank_that_leaves_breaks_the_collective_with_a_typed_error() -> None:
    def work(group: DeviceGroup) -> str:
        if group.rank == 1:
            group.gloo = None  # type: ignore[assignment]
            return "left"
        try:
            group.all_reduce(torch.ones(4))
        except GroupError as exc:
            return str(exc)
        return "no error"

    message = run_ranks(2, work, timeout_s=1.0)[0]
    assert "all-reduce failed on rank 0" in message


def test_a_barrier_waits_longer_than_the_collectives_timeout() -> None:
    """A rank loading its weights again for longer than the group's timeout: the barrier waits for it, and the
    group still works after (a collective would have timed out)."""
    def work(group: DeviceGroup) -> float:
        if group.rank == 1:
            time.sleep(2.5)  # the weights loading again
        group.barrier("load-1")
        return float(group.all_reduce(torch.ones(2))[0])

    assert run_ranks(2, work, timeout_s=1.0) == [2.0, 2.0]

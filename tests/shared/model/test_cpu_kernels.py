"""The CPU kernels (shared/model/kernels): present wherever the machine can build and run them; the
int8 product bit-identical to Int8Linear's torch path (switching backends never changes a token),
decode attention equal to SDPA over the gathered context within float32 rounding."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shared.engine import Engine
from shared.model.attention import decode_kernel_fits
from shared.model.checkpoint import open_checkpoint
from shared.model.cpu_kernels import kernel_status
from shared.model.quant import Int8Linear
from shared.model.sampling import SamplingParams
from tests.conftest import REPO_ROOT

ROOT = REPO_ROOT


def _machine_can_run_kernel() -> bool:
    """x86-64 with AVX-512 VNNI (from /proc/cpuinfo) and a C++ compiler: then the kernels must load."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    return (platform.machine().lower() in ("x86_64", "amd64") and " avx512_vnni" in flags
            and shutil.which("c++") is not None)


def test_kernel_is_used_where_the_machine_can_run_it() -> None:
    status = kernel_status()
    if _machine_can_run_kernel():
        assert status.kernels is not None, status.reason
        assert status.reason == ""
        assert Int8Linear(torch.randn(8, 64)).backend == "vnni"
    else:
        assert status.kernels is None and status.reason
        assert Int8Linear(torch.randn(8, 64)).backend == "torch"


@pytest.mark.parametrize(("out_features", "in_features", "rotate", "with_bias"), [
    (960, 576, True, False),    # SmolLM2 qkv: 64-blocks, several 64-column panels
    (576, 576, False, False),   # o_proj: no rotation
    (200, 1536, True, True),    # a last panel of 8 columns, bias
    (33, 96, True, False),      # 32-blocks (small butterflies), 33 columns
    (70, 42, True, True),       # K not a multiple of 4 (padded groups), 2-blocks
])
def test_kernel_is_bit_identical_to_the_torch_path(out_features: int, in_features: int, rotate: bool,
                                                   with_bias: bool) -> None:
    torch.manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features) if with_bias else None
    reference = Int8Linear(weight, bias, rotate, use_kernel=False)
    fused = Int8Linear(weight, bias, rotate)
    assert reference.backend == "torch"
    for rows in (1, 2, 5, 6, 7, 16, 37):
        x = torch.randn(rows, in_features) * 3
        x[:, 1] *= 60.0  # an outlier channel
        x[-1] = 0.0      # an all-zero row (the scale floor)
        torch.testing.assert_close(fused(x), reference(x), rtol=0, atol=0)


def test_engine_tokens_do_not_depend_on_the_backend(tiny_checkpoints: dict[str, Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.model import cpu_kernels

    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[5, 17, 33, 101, 7], [1, 2, 3], [250, 11, 64, 3, 9, 8, 7]]
    results = []
    for choice in ("auto", "torch"):
        monkeypatch.setenv("AFLEX_CPU_KERNELS", choice)
        engine = Engine.from_checkpoint(open_checkpoint(str(tiny_checkpoints["llama"])), quantize="int8",
                                        num_kv_blocks=64, block_size=4)
        backends = {m.backend for m in engine.ffn.modules() if isinstance(m, Int8Linear)}
        assert backends == ({"torch"} if choice == "torch" or cpu_kernels.load_kernels() is None else {"vnni"})
        results.append([c.token_ids for c in engine.generate(prompts, params)])
    assert results[0] == results[1]


def _sdpa_over_gathered_context(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                                lengths: torch.Tensor) -> torch.Tensor:
    """The torch path: gather each row's padded context, masked SDPA (enable_gqa)."""
    k_ctx, v_ctx = k_cache[slots].transpose(1, 2), v_cache[slots].transpose(1, 2)  # [B, Hkv, C, hd]
    mask = (torch.arange(slots.shape[1])[None, :] < lengths[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q.unsqueeze(2), k_ctx, v_ctx, attn_mask=mask, enable_gqa=True).squeeze(2)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 16), (8, 8, 128), (6, 2, 48)])
def test_decode_attention_matches_sdpa_over_the_gathered_context(heads: int, kv_heads: int, head_dim: int) -> None:
    kernels = kernel_status().kernels
    if kernels is None:  # the machine cannot run it: attention must then never ask for it
        assert not _machine_can_run_kernel()
        return
    torch.manual_seed(heads * head_dim)
    num_slots, batch = 512, 7
    q = torch.randn(batch, heads, head_dim) * 2
    k_cache, v_cache = torch.randn(num_slots, kv_heads, head_dim), torch.randn(num_slots, kv_heads, head_dim)
    lengths = torch.tensor([1, 2, 15, 16, 17, 100, 300])  # 16-wide softmax blocks and their tails
    slots = torch.zeros(batch, int(lengths.max()), dtype=torch.long)
    for row, length in enumerate(lengths.tolist()):
        slots[row, :length] = torch.randperm(num_slots)[:length]  # scattered, as pages are
    assert decode_kernel_fits(q, k_cache)
    out = kernels.decode_attention(q, k_cache, v_cache, slots, lengths)
    torch.testing.assert_close(out, _sdpa_over_gathered_context(q, k_cache, v_cache, slots, lengths),
                               rtol=1e-5, atol=2e-6)
    # a row reads only its own slots: its output does not depend on the batch's padding or neighbours
    alone = kernels.decode_attention(q[5:6], k_cache, v_cache, slots[5:6, :100], lengths[5:6])
    torch.testing.assert_close(alone, out[5:6], rtol=0, atol=0)


def test_decode_attention_rejects_bad_slots_with_a_message() -> None:
    kernels = kernel_status().kernels
    if kernels is None:
        assert not _machine_can_run_kernel()
        return
    q, cache = torch.randn(1, 2, 16), torch.randn(8, 1, 16)
    with pytest.raises(RuntimeError, match="slot is out of range"):
        kernels.decode_attention(q, cache, cache, torch.tensor([[3, 99]]), torch.tensor([2]))
    with pytest.raises(RuntimeError, match=r"head sizes 16\.\.128"):
        kernels.decode_attention(torch.randn(1, 2, 8), torch.randn(8, 1, 8), torch.randn(8, 1, 8),
                                 torch.tensor([[0]]), torch.tensor([1]))


def test_unknown_kernel_choice_is_a_clear_error() -> None:
    # a fresh interpreter: the choice is read once per process
    result = subprocess.run(
        [sys.executable, "-m", "services.launcher.cli", "generate", "--model", "default", "--quantize", "int8",
         "--prompt-ids", "1,2", "--max-tokens", "1"],
        cwd=ROOT, env={"AFLEX_CPU_KERNELS": "fast", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
        timeout=120)
    assert result.returncode != 0
    assert "AFLEX_CPU_KERNELS='fast'" in result.stderr and "Traceback" not in result.stderr

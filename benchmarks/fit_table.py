"""Which model fits at which worker-group sizes on which GPU, and the KV room left: docs/deploy.md's table.

    python benchmarks/fit_table.py --json out/fit_table.json

For each model and GPU profile, the smallest group the live mesh can form (shared/policy/group_fit.py: the
model's heads, widths and experts divide over it, and each rank's share, embeddings and LM head whole on
every rank, fits 90% of the GPU's memory in bf16) for the whole model (`--attention-tp N --colocate`), the
attention half (`--attention-tp N`) and the FFN half (`--ffn-tp N`, or `--ffn-ep N` for an MoE), with the
KV tokens each attention-holding group has room for. Arithmetic only: no GPU is touched.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadgen.sim.models import get_model
from shared.gpu.emulated import load_profile
from shared.policy.group_fit import Half, fits, kv_room_tokens

MODELS = ("qwen3-32b", "mixtral-8x7b", "llama-3.3-70b", "qwen3-30b-a3b", "qwen3-235b-a22b")
GPUS = ("a800", "h100", "h200", "b200")
SIZES = (1, 2, 4, 8, 16, 32)


def smallest(model: str, gpu: str, half: Half) -> dict[str, object] | None:
    """The smallest formable group of `half` that fits: its flags, ranks and KV room (None: none up to 32)."""
    args, memory = get_model(model), load_profile(gpu).memory_bytes
    for size in SIZES:
        shapes = [(size, 1)] if half != "ffn" or not args.n_experts else [(1, size), (size, 1)]  # EP first
        for tp, ep in shapes:
            if fits(args, half, tp, memory, ep):
                flag = {"whole": "--attention-tp", "attention": "--attention-tp", "ffn": "--ffn-tp"}[half]
                if ep > 1:
                    flag = "--ffn-ep"
                return {"ranks": size, "flag": f"{flag} {size}",
                        "kv_tokens": kv_room_tokens(args, half, tp, memory) if half != "ffn" else None}
    return None


def table() -> list[dict[str, object]]:
    return [{"model": model, "gpu": gpu, **{half: smallest(model, gpu, half) for half in ("whole", "attention", "ffn")}}
            for model in MODELS for gpu in GPUS]


def _cell(fit: object) -> str:
    if not isinstance(fit, dict):
        return "none up to 32"
    kv = fit["kv_tokens"]
    return f"`{fit['flag']}`" + (f", KV {kv / 1e3:,.0f}k tokens" if kv is not None else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = table()
    print("| model | GPU | whole model | attention half | FFN half |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['model']} | {str(row['gpu']).upper()} | {_cell(row['whole'])} | {_cell(row['attention'])} "
              f"| {_cell(row['ffn'])} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

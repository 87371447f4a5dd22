"""Which workers `aflex up` starts: the whole model in one worker on a CPU host, no FFN worker for P/D pools of
whole-model workers, else the attention and FFN workers asked for; and the words the serving line says of them.
"""

from __future__ import annotations

import argparse
import os

WHOLE_MODEL_NOTE = ("the whole model in one worker: on this host's CPU the split's halves would share its cores "
                    "and pay a hop a layer (--ffn-workers 1 splits it)")


def whole_model_here(args: argparse.Namespace) -> bool:
    """Whether `aflex up` serves the whole model in one worker (an attention worker holding the FFN half,
    `colocated`, and no FFN worker): where nothing asks for a split (no `--ffn-workers`, no
    `--provision-kinds`) and the workers compute on this host's CPU. There the halves cannot run apart: they
    take turns on the same cores, and each layer pays a hop on top; measured on 2 cores, the split mesh
    decodes at 0.5-0.7x the in-process engine (docs/benchmarks.md, "The whole model in one worker")."""
    asked = args.ffn_workers is not None or args.provision_kinds is not None \
        or bool(os.environ.get("AFLEX_PROVISION_KINDS"))
    device = args.device or os.environ.get("AFLEX_DEVICE") or "cpu"
    return not asked and device.startswith("cpu")


def resolve_layout(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with the workers decided: where `whole_model_here`, no FFN worker, `colocate` on and the
    scheduler's `provision_kinds` colocated (it makes each such worker `colocated` as it registers); where
    `provision_kinds` is pd-colocated, no FFN worker and `colocate` on too (the plan makes P/D pools of the
    workers); else `ffn_workers` as given (1 by default)."""
    if args.ffn_workers is not None:
        return args
    if args.provision_kinds == "pd-colocated":  # P/D pools of whole-model replicas: no FFN worker to plan
        return argparse.Namespace(**{**vars(args), "ffn_workers": 0, "colocate": True})
    if not whole_model_here(args):
        return argparse.Namespace(**{**vars(args), "ffn_workers": 1})
    return argparse.Namespace(**{**vars(args), "ffn_workers": 0, "colocate": True, "provision_kinds": "colocated"})


def workers_text(args: argparse.Namespace) -> str:
    """What the serving line says of the workers `resolve_layout` decided."""
    if args.ffn_workers:
        return f"{args.attention_workers} attention + {args.ffn_workers} FFN workers"
    if args.provision_kinds == "pd-colocated":
        return f"{args.attention_workers} whole-model workers in P/D pools"
    return WHOLE_MODEL_NOTE

"""A rank > 0 of an attention (or whole-model) group: its heads of every pass its rank 0 runs.

Rank 0 owns the sequences, the block tables, sampling and NATS; a follower holds its heads' share of the
weights and of the KV cache (the same slots, its KV heads) and mirrors rank 0's passes step by step
(forward.py sends each before running rank 0's share):

- `PASS`: a microbatch begins: its sequences' positions and KV slots, tokens, block copies, clocks;
- `ATTEND`: layer l's attention, after the previous layer's FFN output (sent along when it came over the
  seam; the group's own when the FFN ran here, `FFN`); the layer's all-reduce meets rank 0's;
- `FFN`: a colocated layer's FFN share over this rank's own copy of the FFN input;
- `END`: the microbatch is over (done or failed): the ranks' energies are summed for rank 0's books;
- `KV_GATHER`, `KV_PUT`: a P/D handoff's KV, this rank's heads of it (kv_heads.py).

The residual stream is whole on every rank (the all-reduces make it the same everywhere), so nothing but
the FFN output travels in a step. Logits and sampling are rank 0's alone (its LM head is whole).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from services.attention_worker.halves import Halves, load_halves
from services.attention_worker.kv_heads import KV_GATHER, KV_PUT, gather, put
from services.worker_base.ffn_forward import ffn_forward
from services.worker_base.gpu import WorkerGPU
from services.worker_base.rank_group import follow_clocks, follow_commands
from shared.gpu.base import OperatorWork
from shared.gpu.workload import attention_work
from shared.model.attention import AttentionHalf, AttentionMeta, PagedKVStore, SequencePass
from shared.model.ffn import FFNHalf
from shared.settings import AttentionWorkerSettings
from shared.transport.device_group import Command, DeviceGroup

log = logging.getLogger("aflex.attention_worker")

PASS, ATTEND, FFN, END = "pass", "attend", "ffn", "end"
RELEASE, LOAD = "release", "load"  # rank 0 parked cold, and loads again


@dataclass
class _Pass:
    """A microbatch's state on a follower, between its PASS and its END."""

    phase: str
    meta: AttentionMeta
    rope: tuple[Tensor, Tensor]
    residual: Tensor  # [T, D]
    work: OperatorWork  # one layer's attention share, for the GPU's books
    ffn_in: Tensor | None = None
    ffn_out: Tensor | None = None
    energy_j: list[float] = field(default_factory=lambda: [0.0, 0.0])  # attention, FFN


def pass_args(admitted: list[Any], block_size: int) -> dict[str, Any]:
    """PASS's arguments from rank 0's admitted sequences (sequences.Admitted)."""
    return {"passes": [[a.seq_pass.start_pos, a.seq_pass.n_new, a.seq_pass.ctx_slots] for a in admitted],
            "tokens": [tok for a in admitted for tok in a.work.token_ids],
            "copies": [list(c) for a in admitted for c in a.copies], "block_size": block_size}


class AttentionFollower:
    """One follower's halves, KV cache and passes in flight."""

    def __init__(self, settings: AttentionWorkerSettings) -> None:
        self.settings = settings
        self.worker_gpu = WorkerGPU(settings, settings.worker_id, "attention")
        self.group: DeviceGroup | None = None
        self.passes: dict[str, _Pass] = {}
        self.model: AttentionHalf | None = None
        self.ffn: FFNHalf | None = None
        self.kv: PagedKVStore | None = None
        self.halves: Halves | None = None

    def load(self) -> None:
        halves = load_halves(self.settings)
        self.model, self.ffn, self.kv = halves.model, halves.ffn, halves.kv
        if self.group is not None:
            halves.reduce_over(self.group)
        self.halves = halves

    def run(self) -> None:
        s = self.settings
        self.load()
        self.worker_gpu.controller.reset()
        self.group = group = DeviceGroup.join(s.group_address, s.group_rank, s.group_size, torch.device(s.device),
                                              s.group_timeout_s)
        assert self.halves is not None
        self.halves.reduce_over(group)
        log.info("attention group rank %d of %d joined %s on %s (%s)", s.group_rank, s.group_size, s.group_address,
                 s.device, "gloo + nccl" if group.nccl is not None else "gloo")
        follow_commands(group, self.worker_gpu, self._do)

    def _do(self, command: Command) -> None:
        with torch.inference_mode():
            self.do(command.op, command.args, command.tensors)

    def do(self, op: str, args: dict[str, Any], tensors: list[Tensor]) -> None:
        group = self.group
        assert group is not None
        if op == PASS:
            self._begin(args)
        elif op == ATTEND:
            self._attend(args, tensors)
        elif op == FFN:
            step = self.passes[args["mb_id"]]
            assert self.ffn is not None and step.ffn_in is not None
            step.ffn_out, energy_j, _ = ffn_forward(self.ffn, self.worker_gpu, args["layer"], args["phase"],
                                                    step.ffn_in)
            step.energy_j[1] += energy_j
        elif op == END:
            ended = self.passes.pop(args["mb_id"], None)
            group.sum_floats(ended.energy_j if ended is not None else [0.0, 0.0])
        elif op in (KV_GATHER, KV_PUT):  # a P/D handoff's KV: this rank's heads (kv_heads.py)
            assert self.kv is not None and self.halves is not None
            whole_args = self.halves.checkpoint.args
            if op == KV_GATHER:
                gather(self.kv, whole_args, group, args["blocks"], args["block_size"], args["num_tokens"])
            else:
                put(self.kv, whole_args, group, args["slots"], tensors[0])
        elif op == RELEASE:
            self.model = self.ffn = self.kv = None
            self.passes.clear()
        elif op == LOAD:
            self.load()
            group.barrier(args["tag"])
        else:
            log.warning("attention group rank %d: unknown command %r", group.rank, op)

    def _begin(self, args: dict[str, Any]) -> None:
        model, kv = self.model, self.kv
        assert model is not None and kv is not None
        follow_clocks(self.worker_gpu, args["clock"])
        kv.copy_blocks([(src, dst) for src, dst in args["copies"]], args["block_size"])
        device = model.embed_tokens.weight.device
        passes = [SequencePass(start, n_new, slots) for start, n_new, slots in args["passes"]]
        meta = AttentionMeta.build(passes, device)
        rope = model.rope(meta.positions)
        residual = model.embed(torch.tensor(args["tokens"], device=device))
        work = attention_work(model.args, meta.n_tokens, [p.start_pos + p.n_new for p in passes],
                              dtype_bytes=model.weight_bytes)
        self.passes[args["mb_id"]] = _Pass(args["phase"], meta, rope, residual, work)

    def _attend(self, args: dict[str, Any], tensors: list[Tensor]) -> None:
        model, kv, gpu = self.model, self.kv, self.worker_gpu
        assert model is not None and kv is not None
        step = self.passes[args["mb_id"]]
        ffn_out = tensors[0] if tensors else step.ffn_out  # over the seam, or the group's own FFN
        gpu.controller.before_microbatch(step.phase)
        energy0 = gpu.gpu.total_energy_j()
        started = time.perf_counter()
        step.residual, step.ffn_in = model.attend(args["layer"], step.residual, ffn_out, step.rope, step.meta, kv)
        attend_s = time.perf_counter() - started
        gpu.meter.op(step.phase, attend_s, gpu.gpu.run(step.work, attend_s))  # type: ignore[arg-type]
        step.energy_j[0] += gpu.gpu.total_energy_j() - energy0


def follow(settings: AttentionWorkerSettings) -> None:
    """Rank `group_rank`'s life: load its share, join the group, mirror rank 0 until it stops or goes."""
    AttentionFollower(settings).run()

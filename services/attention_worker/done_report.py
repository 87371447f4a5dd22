"""What an attention worker reports of one microbatch: its `MicrobatchDone`, refusals folded in.

Every descriptor gets exactly one Done: with its results, the sequences refused (each with its own
code, so the scheduler can judge blame per sequence) and one `error` summing them up, its timings and
energy. A descriptor that does not decode still gets one when it names its `mb_id`.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from shared.error_types import ErrorType
from shared.messages import ErrorBody, MicrobatchDescriptor, MicrobatchDone, SeqResult


@dataclass
class MicrobatchTiming:
    """A microbatch's seconds and joules on this worker and its FFN worker, as its Done reports them."""

    attention_s: float = 0.0  # embedding, attention layers, lm_head and sampling
    ffn_wait_s: float = 0.0  # from sending ffn_in to having ffn_out, summed over layers
    ffn_compute_s: float = 0.0  # of which the FFN worker's forwards
    attention_energy_j: float = 0.0
    ffn_energy_j: float = 0.0  # the FFN replies' shares of their forwards
    total_s: float = 0.0  # from the task's start to its Done


class Failures:
    """Sequences refused in one microbatch, folded into the Done's single `error`."""

    def __init__(self) -> None:
        self.seq_ids: list[str] = []
        self.codes: dict[str, str] = {}  # each refused sequence's own code
        self.errors: list[tuple[str, str, str]] = []  # (type, code, message)

    def add(self, seq_id: str, error_type: str, code: str, message: str) -> None:
        if seq_id not in self.seq_ids:
            self.seq_ids.append(seq_id)
            self.codes[seq_id] = code
        self.errors.append((error_type, code, message))

    def all_failed(self, desc: MicrobatchDescriptor, message: str, code: str | None, error_type: str) -> None:
        """The whole microbatch failed: its error heads the list, and every sequence is refused."""
        self.errors.insert(0, (error_type, code or "microbatch_failed", f"microbatch {desc.mb_id}: {message}"))
        for work in desc.seqs:
            if work.seq_id not in self.seq_ids:
                self.seq_ids.append(work.seq_id)

    def body(self) -> ErrorBody | None:
        if not self.errors:
            return None
        error_type, code, _ = self.errors[0]
        return ErrorBody(type=error_type, code=code, message="; ".join(m for _, _, m in self.errors))


def microbatch_done(mb_id: str, worker_id: str, kv_free_blocks: int, kv_total_blocks: int,
                    results: list[SeqResult], failures: Failures, timing: MicrobatchTiming | None = None
                    ) -> MicrobatchDone:
    """The Done of a microbatch; without `timing` (a descriptor that did not decode) no energy is reported."""
    t = timing or MicrobatchTiming()
    measured = timing is not None
    return MicrobatchDone(
        mb_id=mb_id, worker_id=worker_id, results=results, kv_free_blocks=kv_free_blocks,
        kv_total_blocks=kv_total_blocks, error=failures.body(), failed_seq_ids=failures.seq_ids,
        failed_codes=failures.codes, attention_s=t.attention_s, ffn_wait_s=t.ffn_wait_s,
        ffn_compute_s=t.ffn_compute_s, total_s=t.total_s,
        energy_j=t.attention_energy_j + t.ffn_energy_j if measured else None,
        attention_energy_j=t.attention_energy_j if measured else None,
        ffn_energy_j=t.ffn_energy_j if measured else None)


def undecodable(data: bytes, reason: str) -> tuple[str, Failures] | None:
    """The mb_id an invalid descriptor still names, and its sequences refused; None when it names none."""
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("mb_id"), str):
        return None
    seqs = raw.get("seqs")
    failures = Failures()
    for seq in seqs if isinstance(seqs, list) else []:
        if isinstance(seq, dict) and isinstance(seq.get("seq_id"), str):
            failures.seq_ids.append(seq["seq_id"])
    failures.errors.append((ErrorType.INVALID_REQUEST, "invalid_descriptor", reason))
    return raw["mb_id"], failures

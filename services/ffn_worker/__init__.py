"""The FFN worker service: stateless per-layer FFNs, merging queued microbatches of a layer."""

from services.ffn_worker.worker import FFNWorker, run

__all__ = ["FFNWorker", "run"]

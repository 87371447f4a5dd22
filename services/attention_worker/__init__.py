"""The attention worker service: embeddings, attention against a paged KV cache, lm_head, sampling."""

from services.attention_worker.worker import AttentionWorker, run

__all__ = ["AttentionWorker", "run"]

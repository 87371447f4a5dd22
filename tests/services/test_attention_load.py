"""The attention worker resolves its CPU kernels while it loads (a thread, before it registers), never on
its first forward: a build there (~30 s where none is cached) ran on the event loop, its heartbeats
stopped, the scheduler called it unhealthy and the first requests got 503 `no_workers_ready`."""

from __future__ import annotations

from pathlib import Path

from services.attention_worker.worker import AttentionWorker
from shared.model import cpu_kernels
from shared.settings import AttentionWorkerSettings


def test_load_resolves_the_cpu_kernels_before_any_forward(tiny_checkpoints: dict[str, Path]) -> None:
    cpu_kernels._status.cache_clear()
    worker = AttentionWorker(AttentionWorkerSettings(nats_url="nats://127.0.0.1:1", worker_id="attn-load",
                                                     model=str(tiny_checkpoints["llama"]), num_kv_blocks=8,
                                                     gpu_backend="emulated"))
    assert cpu_kernels._status.cache_info().currsize == 0
    worker.load()
    assert cpu_kernels._status.cache_info().currsize == 1  # built or found missing: decided, not left for later
    assert worker.sequences is not None and worker.kv is not None

"""Which GPU profile (the emulated GPU's speed and power tables) each worker's GPU is.

A worker registers a profile name, a GPU name, or neither. aflex prices a worker (its clocks, its
prefill cap, the global plan) only once its profile is known, so the lookup, and its guess from the
GPU name, is made once per pair of names here and shared by all three.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.registry import Worker
from shared.gpu.base import GPUError
from shared.gpu.emulated import GPUProfile, available_profiles, load_profile


class Profiles:
    """The GPU profiles of the workers seen so far, by (registered profile, GPU name)."""

    def __init__(self) -> None:
        self._by_names: dict[tuple[str, str], GPUProfile | None] = {}

    def of(self, worker: Worker) -> GPUProfile | None:
        """The worker's GPU profile: as registered, or guessed from its GPU name; None when unknown."""
        return self.named(worker.gpu_profile, worker.gpu_name)

    def named(self, gpu_profile: str, gpu_name: str) -> GPUProfile | None:
        """The GPU profile of a worker registering with these names (a registration's, before it joins)."""
        key = (gpu_profile, gpu_name)
        if key not in self._by_names:
            name = guess_profile(gpu_profile, gpu_name, available_profiles())
            try:
                self._by_names[key] = load_profile(name) if name else None
            except GPUError:
                self._by_names[key] = None
        return self._by_names[key]


def guess_profile(gpu_profile: str, gpu_name: str, available: Sequence[str]) -> str | None:
    """The profile key of a worker: its own `gpu_profile` if known, else one guessed from the GPU name
    ("NVIDIA H200" -> "h200", "emulated A800-SXM4-80GB" -> "a800"); None when neither is known."""
    keys = sorted((k.lower() for k in available), key=len, reverse=True)
    if gpu_profile and gpu_profile.lower() in keys:
        return gpu_profile.lower()
    name = gpu_name.lower()
    return next((k for k in keys if k in name), None) if name else None

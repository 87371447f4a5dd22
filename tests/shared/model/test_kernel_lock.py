"""A build lock left by a process killed mid-build is removed (torch would wait on it forever); a fresh one,
maybe another process's build in progress, is left alone."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from shared.model import cpu_kernels


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / cpu_kernels._EXTENSION_NAME / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    cpu_kernels._drop_stale_lock()
    assert lock.exists()  # a build may be running now
    old = time.time() - cpu_kernels.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    cpu_kernels._drop_stale_lock()
    assert not lock.exists()
    cpu_kernels._drop_stale_lock()  # no lock: nothing to do

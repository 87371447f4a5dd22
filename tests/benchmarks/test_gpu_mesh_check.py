"""benchmarks/gpu_mesh_check.py on the CPU with the emulated backend (what a lent GPU runs, minus
the GPU): the mesh comes up, and the report has both halves' times, the hop, and a modelled
energy per token that says it is modelled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "gpu_mesh_check.py"


def test_reports_each_half_the_hop_and_energy(tmp_path: Path, tiny_chat_checkpoint: Path) -> None:
    out = tmp_path / "gpu_mesh_check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_chat_checkpoint), "--device", "cpu",
                           "--gpu-backend", "emulated", "--concurrency", "4", "--max-tokens", "12",
                           "--json", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["decode_microbatches"] > 0 and report["seam"] == "gloo"
    assert report["attention_per_layer_ms"] > 0 and report["ffn_compute_per_layer_ms"] > 0
    assert report["hop_per_layer_ms"] > 0 and report["step_ms"] > 0 and report["decode_tok_s"] > 0
    assert report["energy_per_token_j"] > 0 and report["energy_accounting"].startswith("modelled")

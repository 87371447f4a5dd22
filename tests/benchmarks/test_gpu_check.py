"""benchmarks/gpu_check.py on the CPU with the emulated backend: every (model, half, phase, batch)
entry is there with positive times and energies, the modelled side is filled in, and the JSON is
written even when --max-seconds cuts the run short."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT

ROOT = REPO_ROOT
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
SMALL = ["--device", "cpu", "--gpu-backend", "emulated", "--profile", "h200", "--context", "32",
         "--prefill-tokens", "32", "--repeats", "1", "--qwen3-layers", "1", "--qwen3-scale", "small",
         "--window", "0.02", "--idle-seconds", "0.02", "--warmup", "1"]


def run_check(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), *SMALL, *extra, "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_every_entry_measured_and_modelled(tmp_path: Path) -> None:
    report = run_check(tmp_path, "--models", "smollm2,qwen3-8b", "--batches", "1,2")
    assert not report["stopped_early"]
    assert report["clocks_set"] is False
    assert report["environment"]["gpu_backend"] == "emulated"
    assert report["environment"]["torch"] == torch.__version__
    assert report["models"]["qwen3-8b"]["args"]["n_layers"] == 1
    assert report["models"]["qwen3-8b"]["args"]["qk_norm"] is True
    assert report["models"]["smollm2"]["args"]["dim"] == 576
    keys = {(r["model"], r["half"], r["phase"], r["batch"]) for r in report["results"]}
    expected = {(m, h, "prefill", 1) for m in ("smollm2", "qwen3-8b") for h in ("attention", "ffn")}
    expected |= {(m, h, "decode", b) for m in ("smollm2", "qwen3-8b") for h in ("attention", "ffn") for b in (1, 2)}
    assert keys == expected
    for row in report["results"]:
        assert row["time_per_call_s"] > 0 and row["time_per_token_s"] > 0
        assert row["energy_per_call_j"] > 0 and row["energy_per_token_j"] > 0
        assert row["sm_clock_mhz"] > 0
        assert row["tokens_per_call"] == (32 if row["phase"] == "prefill" else row["batch"])
        assert row["work"]["kind"] == f"{row['half']}.{row['phase']}"
        modelled = row["modelled"]
        assert modelled["time_per_token_s"] > 0 and modelled["energy_per_token_j"] > 0
        assert modelled["time_ratio_measured_over_modelled"] > 0
        # the emulated backend's energy is the profile's own: the ratio is 1
        assert modelled["energy_ratio_measured_over_modelled"] == pytest.approx(1.0, rel=1e-6)


def test_stops_at_max_seconds_and_still_writes_json(tmp_path: Path) -> None:
    report = run_check(tmp_path, "--models", "qwen3-8b", "--batches", "1", "--max-seconds", "0")
    assert report["stopped_early"] is True
    assert report["results"] == []
    assert "idle" in report


def test_refuses_a_backend_that_could_set_clocks() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    with pytest.raises(SystemExit, match="only reads"):
        gpu_check.open_gpu("nvml", "h200", torch.device("cpu"))
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--gpu-backend", "nvml"])

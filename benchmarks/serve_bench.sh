#!/usr/bin/env bash
# Issue 28's guard: `vllm bench serve` (random 128 in / 32 out, 32 prompts, 16 at once) against `aflex up`,
# beside the in-process engine; writes out/serve_bench.json. Arguments: benchmarks/serve_bench.py --help.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
[ -d .venv ] && . .venv/bin/activate
exec python benchmarks/serve_bench.py "$@"

#!/usr/bin/env bash
# The test command: installs what the tests need, then lint and the whole test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k parity).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh worker,dev
. .venv/bin/activate
# The CPU kernels compile once per machine (~30 s, one core): build them while ruff and mypy run.
# A failed build is no failure here: the torch paths run, and the kernel tests say why.
python -c "from shared.model.cpu_kernels import kernel_status; kernel_status()" &
kernels_pid=$!
ruff check .
mypy
wait "$kernels_pid" || echo "CPU kernels not built; the torch paths run" >&2
python -m pytest -q "$@"

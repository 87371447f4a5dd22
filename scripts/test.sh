#!/usr/bin/env bash
# The test command: installs what the tests need, then lint and the whole test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k parity).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh worker,dev
. .venv/bin/activate
ruff check .
mypy
python -m pytest -q "$@"

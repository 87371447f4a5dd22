#!/usr/bin/env bash
# Brings AFlex up with the default model (SmolLM2-135M-Instruct), installing what it needs.
# Extra arguments go to `aflex generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh worker
. .venv/bin/activate
if [ $# -eq 0 ]; then
  set -- --chat --prompt "What is the capital of France?" --max-tokens 20
fi
exec aflex generate --model default "$@"

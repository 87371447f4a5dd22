#!/usr/bin/env bash
# Brings the whole AFlex mesh up with the default model (SmolLM2-135M-Instruct) on :8000,
# installing what it needs: an embedded nats-server, the scheduler, one attention worker, one
# FFN worker and the OpenAI-compatible gateway. Extra arguments go to `aflex up`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh worker
. .venv/bin/activate
exec aflex up --model default --port 8000 "$@"

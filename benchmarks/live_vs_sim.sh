#!/usr/bin/env bash
# Issue 6's done-when: replay the conv trace's first 120 s against a live `aflex up` (SmolLM2-135M,
# 1 attention + 1 FFN worker on the CPU, emulated A800 clocks and energy), then the same window in
# `aflex sim` (SmolLM2-135M shape, 2 modelled A800s). Results in out/bench/, see docs/benchmarks.md.
#
#   bash benchmarks/live_vs_sim.sh            # S=0.25, prompts clipped to 128 and outputs to 16 tokens
#   S=0.5 MAX_IN=256 MAX_OUT=32 bash benchmarks/live_vs_sim.sh
#
# The two tools read --time-scale the opposite ways: `aflex bench` divides the trace's arrival offsets
# by it (0.25 = four times slower) and cuts --window on the trace's own clock; `aflex sim` multiplies
# them (4 = four times slower) and cuts --window on the scaled clock. So bench S over 0:120 is sim 1/S
# over 0:120/S: the same ~660 requests at the same arrival times.
set -euo pipefail
cd "$(dirname "$0")/.."
S="${S:-0.25}"
MAX_IN="${MAX_IN:-128}"
MAX_OUT="${MAX_OUT:-16}"
PORT="${PORT:-8000}"
NATS_PORT="${NATS_PORT:-4222}"
mkdir -p out/bench
SIM_SCALE=$(python -c "print(1 / $S)")
SIM_END=$(python -c "print(120 / $S)")

aflex up --model default --port "$PORT" --nats-port "$NATS_PORT" --gpu-profile a800 > out/bench/mesh.log 2>&1 &
MESH=$!
trap 'kill -TERM "$MESH" 2>/dev/null; wait "$MESH" || true' EXIT
until grep -q "AFlex is serving" out/bench/mesh.log; do
  kill -0 "$MESH" || { cat out/bench/mesh.log; exit 1; }
  sleep 1
done

aflex bench --url "http://127.0.0.1:$PORT" --trace conv --window 0:120 --time-scale "$S" \
  --max-input-len "$MAX_IN" --max-output-len "$MAX_OUT" --tokenizer default \
  --nats "nats://127.0.0.1:$NATS_PORT" --goodput ttft:400 tpot:120 \
  --json out/bench/live-conv.json --plots out/bench/plots --no-progress | tee out/bench/live-conv.log

kill -TERM "$MESH"
wait "$MESH" || true
trap - EXIT

aflex sim --trace conv --window "0:$SIM_END" --time-scale "$SIM_SCALE" \
  --max-input-len "$MAX_IN" --max-output-len "$MAX_OUT" \
  --model smollm2-135m --gpu a800 --gpus 2 --policies aflex,colocated-max,af-max,phase-dvfs \
  --ttft-slo-ms 400 --tpot-slo-ms 120 --json out/bench/sim-conv.json

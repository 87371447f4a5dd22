#!/usr/bin/env bash
# Replay the conv trace's first END s (120) against a live `aflex up` (SmolLM2-135M on the CPU, emulated
# A800 clocks and energy), then the same window in `aflex sim` (SmolLM2-135M shape, modelled A800s).
# Results in out/bench/, see docs/benchmarks.md ("Live replay vs the simulator").
#
#   bash benchmarks/live_vs_sim.sh            # issue 6: 1 attention + 1 FFN worker, every sim policy
#   S=0.5 MAX_IN=256 MAX_OUT=32 bash benchmarks/live_vs_sim.sh
#   A=2 F=2 KINDS=mixed PLAN_WINDOW_S=60 END=60 bash benchmarks/live_vs_sim.sh
#       # issue 26: 4 workers under the global scheduler, live and in the sim (`aflex-mixed-only`, or
#       # `aflex-pd-only` with KINDS=pd), each planning every PLAN_WINDOW_S on the replay's clock; the
#       # live plans are recorded from `aflex.v1.telemetry.plan` (out/bench/live-plans.jsonl) and set
#       # beside the sim's (benchmarks/plan_sequence.py)
#
# The two tools read --time-scale the opposite ways: `aflex bench` divides the trace's arrival offsets
# by it (0.25 = four times slower) and cuts --window on the trace's own clock; `aflex sim` multiplies
# them (4 = four times slower) and cuts --window on the scaled clock. So bench S over 0:END is sim 1/S
# over 0:END/S: the same requests at the same arrival times.
set -euo pipefail
cd "$(dirname "$0")/.."
S="${S:-0.25}"
MAX_IN="${MAX_IN:-128}"
MAX_OUT="${MAX_OUT:-16}"
END="${END:-120}"
A="${A:-1}"
F="${F:-1}"
KINDS="${KINDS:-auto}"
PLAN_WINDOW_S="${PLAN_WINDOW_S:-300}"
PORT="${PORT:-8000}"
NATS_PORT="${NATS_PORT:-4222}"
mkdir -p out/bench
SIM_SCALE=$(python -c "print(1 / $S)")
SIM_END=$(python -c "print($END / $S)")
GPUS=$((A + F))
if [ "$GPUS" -ge 4 ]; then
  POLICIES="${POLICIES:-aflex-${KINDS/auto/mixed}-only}"
else
  POLICIES="${POLICIES:-aflex,colocated-max,af-max,phase-dvfs}"
fi

aflex up --model default --port "$PORT" --nats-port "$NATS_PORT" --gpu-profile a800 \
  --attention-workers "$A" --ffn-workers "$F" --provision-window-s "$PLAN_WINDOW_S" --provision-kinds "$KINDS" \
  > out/bench/mesh.log 2>&1 &
MESH=$!
RECORDER=""
trap 'kill -TERM "$MESH" $RECORDER 2>/dev/null; wait "$MESH" || true' EXIT
until grep -q "AFlex is serving" out/bench/mesh.log; do
  kill -0 "$MESH" || { cat out/bench/mesh.log; exit 1; }
  sleep 1
done
# the embedded nats-server has a user per role: telemetry is read as the `telemetry` user
TELEMETRY_URL=$(grep -o "telemetry subscribers: [^ ]*" out/bench/mesh.log | head -1 | cut -d' ' -f3)
python -m tools.record_subject --nats "$TELEMETRY_URL" --subject aflex.v1.telemetry.plan \
  --out out/bench/live-plans.jsonl &
RECORDER=$!

LIVE_START=$(date +%s.%N)
aflex bench --url "http://127.0.0.1:$PORT" --trace conv --window "0:$END" --time-scale "$S" \
  --max-input-len "$MAX_IN" --max-output-len "$MAX_OUT" --tokenizer default \
  --nats "$TELEMETRY_URL" --goodput ttft:400 tpot:120 \
  --json out/bench/live-conv.json --plots out/bench/plots --no-progress | tee out/bench/live-conv.log

LIVE_END=$(date +%s.%N)
kill -TERM "$RECORDER" 2>/dev/null || true
kill -TERM "$MESH"
wait "$MESH" || true
trap - EXIT

aflex sim --trace conv --window "0:$SIM_END" --time-scale "$SIM_SCALE" \
  --max-input-len "$MAX_IN" --max-output-len "$MAX_OUT" \
  --model smollm2-135m --gpu a800 --gpus "$GPUS" --window-s "$PLAN_WINDOW_S" --policies "$POLICIES" \
  --ttft-slo-ms 400 --tpot-slo-ms 120 --json out/bench/sim-conv.json
if [ "$GPUS" -ge 4 ]; then
  python benchmarks/plan_sequence.py --live out/bench/live-plans.jsonl --live-bench out/bench/live-conv.json \
    --sim out/bench/sim-conv.json --window-s "$PLAN_WINDOW_S" --live-start "$LIVE_START" --live-end "$LIVE_END" \
    --json out/bench/plan-sequence.json
fi

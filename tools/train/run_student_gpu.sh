#!/usr/bin/env bash
# One time-boxed GPU run of the LoRA student trainer (tools/train/student.py), resuming from $STATE when that holds a
# state; with TRAIN_BASE=1 (the default) the base is trained beside it (--train-base, opening clips OPENINGS).
#
#   OUT=/path/for/results BASE=<FL2VA/transformer dir> VAE_ROOT=<trained VAEs> ENCODER_ROOT=<tiny MiniMax-H3 tree> \
#       STATE=<state dir> MINUTES=8 tools/train/run_student_gpu.sh
#
# Writes under $OUT: student.log (the trainer's output), gpu.txt (utilisation and memory after GPU_AFTER seconds),
# and the resumable state.pt with its loss log log.jsonl (copy both into a state directory to resume). The trainer
# is stopped by `timeout` LIMIT seconds after it starts (default: MINUTES plus 1 minute), so a state saved every
# SAVE_EVERY steps comes back even then. Knobs: PY, DEVICE, SESSIONS, LR, OPENINGS, WORKERS, SAVE_EVERY,
# STUDENT_ARGS (extra arguments).
set -uo pipefail
: "${OUT:?set OUT to the results directory}" "${BASE:?}" "${VAE_ROOT:?}" "${ENCODER_ROOT:?}" "${STATE:?}"
PY=${PY:-python3}
MINUTES=${MINUTES:-8}
LIMIT=${LIMIT:-$(python3 -c "print(int($MINUTES * 60 + 60))")}
mkdir -p "$OUT" "$STATE"
export PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null; then
    (sleep "${GPU_AFTER:-150}"; nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv > "$OUT/gpu.txt") &
fi
joint=()
if [ "${TRAIN_BASE:-1}" = 1 ]; then joint=(--train-base --openings "${OPENINGS:-0.5}"); fi
timeout "$LIMIT" "$PY" -m tools.train.student --base "$BASE" --vae-root "$VAE_ROOT" --encoder-root "$ENCODER_ROOT" \
    --state "$STATE" --device "${DEVICE:-cuda}" --minutes "$MINUTES" --sessions "${SESSIONS:-8}" --lr "${LR:-1e-3}" \
    --workers "${WORKERS:-12}" --log-every 5 --save-every "${SAVE_EVERY:-50}" "${joint[@]}" ${STUDENT_ARGS:-} \
    > "$OUT/student.log" 2>&1
echo "trainer exit $?"
tail -n 4 "$OUT/student.log"
cp "$STATE/state.pt" "$STATE/log.jsonl" "$OUT/"
ls -la "$OUT"

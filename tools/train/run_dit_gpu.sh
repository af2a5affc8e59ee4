#!/usr/bin/env bash
# One time-boxed GPU run of the DiT base trainer (tools/train/dit.py), resuming from $STATE when that holds a state.
#
#   OUT=/path/for/results VAE_ROOT=<trained VAEs> ENCODER_ROOT=<tiny MiniMax-H3 tree> MINUTES=6 \
#       tools/train/run_dit_gpu.sh
#
# Writes under $OUT: dit.log (the trainer's output), gpu.txt (utilisation and memory after GPU_AFTER seconds), and
# the resumable state.pt with its loss log log.jsonl (copy both into a state directory to resume). The trainer is
# stopped by `timeout` LIMIT seconds after it starts (default: MINUTES plus 2 minutes), so a state saved every
# SAVE_EVERY steps comes back even then. Knobs: PY, DEVICE, ACCUM, WORKERS, SAVE_EVERY, DIT_ARGS (extra arguments,
# e.g. `--frames 22 --max-steps 2` for a smoke run on the CPU).
set -uo pipefail
: "${OUT:?set OUT to the results directory}" "${VAE_ROOT:?}" "${ENCODER_ROOT:?}"
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
MINUTES=${MINUTES:-6}
STATE=${STATE:-out/dit_state}
LIMIT=${LIMIT:-$(python3 -c "print(int($MINUTES * 60 + 120))")}
mkdir -p "$OUT" "$STATE"
export PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null; then
    (sleep "${GPU_AFTER:-120}"; nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv > "$OUT/gpu.txt") &
fi
timeout "$LIMIT" "$PY" -m tools.train.dit --vae-root "$VAE_ROOT" --encoder-root "$ENCODER_ROOT" --state "$STATE" \
    --device "$DEVICE" --minutes "$MINUTES" --accum "${ACCUM:-8}" --workers "${WORKERS:-12}" \
    --save-every "${SAVE_EVERY:-200}" ${DIT_ARGS:-} > "$OUT/dit.log" 2>&1
echo "trainer exit $?"
tail -n 4 "$OUT/dit.log"
cp "$STATE/state.pt" "$STATE/log.jsonl" "$OUT/"
ls -la "$OUT"

#!/usr/bin/env bash
# One time-boxed GPU run: the video and the audio VAE trainers side by side on one GPU, each resuming from
# out/train_state/<kind> when that holds a state, then the held-out figures of what they exported.
#
#   OUT=/path/for/results MINUTES=7 tools/train/run_vae_gpu.sh
#
# Writes under $OUT: results.tar (both training logs and loss logs, the figures JSON, a preview PNG of originals
# beside decodes, the exported configs) and state.tar.part-* (the resumable states, split in 15 MiB parts:
# `cat state.tar.part-* | tar -x -C out/train_state` restores them). The weights do not come back (the states and
# the weights together pass what a call returns): `python -m tools.train.vae --export-only` writes them from a state.
# Knobs: MINUTES (training time of each trainer), PY (python), DEVICE, VIDEO_ARGS / AUDIO_ARGS / EVAL_ARGS
# (extra arguments, e.g. for a smoke run on the CPU).
set -uo pipefail
: "${OUT:?set OUT to the results directory}"
MINUTES=${MINUTES:-7}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
STATE=${STATE:-out/train_state}
EXPORT=out/trained
mkdir -p "$OUT" "$STATE" "$EXPORT"
export PYTHONUNBUFFERED=1

"$PY" -m tools.train.vae --kind video --state "$STATE/video" --export "$EXPORT" --device "$DEVICE" \
    --minutes "$MINUTES" --batch 8 --lr 4e-4 --workers 10 ${VIDEO_ARGS:-} > "$STATE/video.log" 2>&1 &
video=$!
"$PY" -m tools.train.vae --kind audio --state "$STATE/audio" --export "$EXPORT" --device "$DEVICE" \
    --minutes "$MINUTES" --batch 16 --lr 3e-4 --workers 4 ${AUDIO_ARGS:-} > "$STATE/audio.log" 2>&1 &
audio=$!
sleep "${CHECK_AFTER:-120}"  # both must be past their first steps: else stop at once instead of spending the lease
for pid in $video $audio; do
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "a trainer stopped early"; tail -n 30 "$STATE/video.log" "$STATE/audio.log"
        kill $video $audio 2>/dev/null; wait; exit 1
    fi
done
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv
tail -n 2 "$STATE/video.log" "$STATE/audio.log"
wait $video; echo "video trainer exit $?"
wait $audio; echo "audio trainer exit $?"
tail -n 3 "$STATE/video.log" "$STATE/audio.log"

"$PY" -m tools.train.vae_eval --root "$EXPORT" --device "$DEVICE" --json "$STATE/vae_metrics.json" \
    --preview "$STATE/preview.png" ${EVAL_ARGS:-} > "$STATE/eval.log" 2>&1
echo "eval exit $?"
cat "$STATE/vae_metrics.json"

tar -cf "$OUT/results.tar" -C "$STATE" video.log audio.log eval.log vae_metrics.json preview.png \
    video/log.jsonl audio/log.jsonl -C "$PWD/$EXPORT" vae/config.json audio_vae/config.json
tar -cf - -C "$STATE" video/state.pt audio/state.pt | split -b 15M - "$OUT/state.tar.part-"
ls -la "$OUT"

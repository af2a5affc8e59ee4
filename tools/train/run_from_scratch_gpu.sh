#!/usr/bin/env bash
# The whole tiny model from nothing on one GPU: the VAEs, the base DiT and the LoRA student, as one background job
# that outlives the device call that starts it (each call is at most 10 minutes; the job needs about 25).
#
#   W=<work dir> ENCODER_ROOT=<tiny MiniMax-H3 tree> tools/train/run_from_scratch_gpu.sh start
#   W=<work dir> OUT=<results dir> WAIT=<seconds> [STOP="<trainers>" STOP_AFTER=<seconds>] \
#       tools/train/run_from_scratch_gpu.sh collect
#
# `start` detaches the job (setsid) and returns. `collect` waits WAIT seconds or until the job is done, whichever
# comes first, then copies what exists into $OUT, within what a call may return (8 files, 16 MiB each, 64 MiB in
# all): vae.tar (the final VAEs) or, until they are done, vae_root.tar (stage 1's), dit.tar (the base after stage
# 2, the student's LoRA and base), logs.tar, and the resumable states of the trainers still training (the VAEs'
# in parts of 15 MiB: NAME.state.pt.partNN).
# STOP names trainers (vae_video vae_audio base joint, or all) to end STOP_AFTER seconds into the wait (default 0):
# each saves, exports and hands on to the next stage as if its minutes were up (a file `stop` in its state
# directory), so a call whose device time runs out can still end with the job's exports.
# Each call that collects keeps the machine busy, so the job goes on. A call that starts with FROM=<a folder of what
# an earlier call returned> carries on from there (carry_in, below): a lost machine loses only the time since the
# last collect, and a run can span calls that each stand alone.
#
# Stages (knobs in minutes):
#   1. the video and audio VAEs side by side for VAE_MIN; exported to $W/vae_root, the latents the DiT trains on;
#   2. the decoders go on alone (--freeze-encoder, the latents fixed) for DEC_MIN, beside the base DiT trained from
#      random weights for BASE_MIN (teacher documents TEACHER_DOCS, opening clips OPENINGS of the clips). The video
#      decoder trains on DEC_DISTINCT windows and the base on BASE_DISTINCT seeds, each encoded once and kept on the
#      GPU: the frozen video encoder is almost all of what either would otherwise compute at every step;
#   3. the joint student (--train-base --openings JOINT_OPENINGS) from that base for JOINT_MIN; its LoRA and base
#      exported to $W/export/lora and $W/export/base. With FROZEN_TEACHER=1 the student trains its LoRA and the
#      base's video-only weights (--video-weights): the audio teacher, which reads none of them, stays stage 2's.
# $W/progress names the last stage begun; $W/done holds the job's exit status when it ends. Knobs: PY, BASE_LR,
# BASE_ACCUM, LR (the student's), SESSIONS, SWITCH (the student's prompt switches, a fraction of its sessions),
# FIRST_WEIGHT (the weight of each request's first phase in the student's loss), SELF_COMMIT (the fraction of the
# student's steps that commit its own output, as served, instead of the clean latents), SINK_GAP (the most time
# units, 40 a second, by which the student's sink moves back, as later requests see it; 0: never), SERVED_FROM (the
# student's step from which SELF_COMMIT and SINK_GAP apply; default 0), SOUND_SPREAD (px: the deviation of how far
# each student session's sound stands to the side of its picture; default 0), SPREAD_REQUESTS (how many of a
# session's requests, from the first, have their sound set aside; default 2, both), BASE_OWN_LOSS_ONLY (1: the
# student's loss trains its LoRA only, its base part learning from the base's own objective alone), FROZEN_TEACHER (1:
# above; refused with BASE_OWN_LOSS_ONLY or JOINT_OPENINGS, which only the base's own objective uses), JOINT_DISTINCT
# (the student trains on that many sessions, each encoded once and kept on the GPU, and its base part on as many
# seeds; unset: every session new, encoded at every step), BASE_STEPS and JOINT_STEPS (the base and the student end
# at that step, or at their minutes if those come first: a recipe pinned in steps, the minutes set high, trains
# the same on machines of different pace; a call that ends sooner carries on through FROM),
# VIDEO_BATCH, AUDIO_BATCH, *_WORKERS (small values make a CPU smoke run).
set -uo pipefail
: "${W:?set W to the work directory}"
cmd=${1:?start or collect}
PY=${PY:-python3}

# the decoders of stage 2 both exported (a half-written $W/export/vae is not the final VAEs)
vaes_done() { [ -f "$W/state/video_done" ] && [ -f "$W/state/audio_done" ]; }

# one VAE trainer: kind (video|audio), export root, minutes, workers, log name, extra flags; the kind's own
# state, batch and learning rate
train_vae() {
    local kind=$1 batch=${AUDIO_BATCH:-16} lr=3e-4
    [ "$kind" = video ] && batch=${VIDEO_BATCH:-8} lr=4e-4
    "$PY" -m tools.train.vae --kind "$kind" --state "$W/state/vae_$kind" --export "$2" --minutes "$3" \
        --batch "$batch" --lr "$lr" --workers "$4" "${@:6}" > "$W/logs/$5.log" 2>&1
}

# stage 2's decoder of one kind (video|audio, its folder, workers): trained on alone from its state into
# $W/export/vae, or where a call carried stage 1's VAEs without that state, stage 1's taken as final
decoder() {
    local kind=$1 sub=$2 dec_root=$W/export/vae
    [ -f "$W/state/${kind}_done" ] && return 0
    if [ -f "$W/state/vae_$kind/state.pt" ]; then
        local windows=()
        [ "$kind" = video ] && windows=(--distinct "${DEC_DISTINCT:-8192}")
        train_vae "$kind" "$dec_root" "${DEC_MIN:-8}" "$3" "dec_$kind" --freeze-encoder "${windows[@]}" || return 1
    else
        rm -rf "${dec_root:?}/$sub" && mkdir -p "$dec_root" && cp -r "$W/vae_root/$sub" "$dec_root/$sub" || return 1
    fi
    touch "$W/state/${kind}_done"
}

stage() { echo "$(date -u +%T) $1" | tee -a "$W/progress"; }

job() {
    set -x
    local vae_root=$W/vae_root video="" audio=""
    # wait for stage 2's decoders, if they run, so that the job ends only once their exports are whole
    decoders() { if [ -n "$video" ]; then wait $video && wait $audio; fi; }
    if vaes_done; then
        vae_root=$W/export/vae  # the final VAEs: the same encoder and latent statistics as stage 1's
    elif [ -d "$W/vae_root" ]; then
        stage "1 vaes (carried)"
    else
        stage "1 vaes"
        train_vae video "$vae_root" "${VAE_MIN:-4.5}" "${VIDEO_WORKERS:-8}" vae_video &
        video=$!
        train_vae audio "$vae_root" "${VAE_MIN:-4.5}" "${AUDIO_WORKERS:-4}" vae_audio &
        audio=$!
        wait $video && wait $audio || return 1
    fi

    if [ ! -d "$W/export/base_stage2" ]; then
        stage "2 base + decoders"
        if ! vaes_done; then
            decoder video vae 4 &
            video=$!
            decoder audio audio_vae 2 &
            audio=$!
        fi
        "$PY" -m tools.train.dit --vae-root "$vae_root" --encoder-root "$ENCODER_ROOT" --state "$W/state/base" \
            --minutes "${BASE_MIN:-9}" --accum "${BASE_ACCUM:-8}" --lr "${BASE_LR:-6e-4}" --warmup 100 \
            --workers "${BASE_WORKERS:-8}" --teacher-docs "${TEACHER_DOCS:-0.25}" --openings "${OPENINGS:-0.75}" \
            --distinct "${BASE_DISTINCT:-4096}" \
            --save-every 100 --export "$W/export/base_stage2" ${BASE_STEPS:+--max-steps "$BASE_STEPS"} \
            > "$W/logs/base.log" 2>&1 || { decoders; return 1; }
    fi
    stage "3 joint student"
    local sessions=()
    [ -n "${JOINT_DISTINCT:-}" ] && sessions=(--distinct "$JOINT_DISTINCT")
    # the base part: trained on beside the LoRA, or (FROZEN_TEACHER=1) in its video-only weights alone
    local base_part=(--train-base --openings "${JOINT_OPENINGS:-0.75}")
    if [ "${FROZEN_TEACHER:-0}" = 1 ]; then
        base_part=(--video-weights)
    elif [ "${BASE_OWN_LOSS_ONLY:-0}" = 1 ]; then
        base_part+=(--base-own-loss-only)
    fi
    "$PY" -m tools.train.student --base "$W/export/base_stage2/FL2VA/transformer" --vae-root "$vae_root" \
        --encoder-root "$ENCODER_ROOT" --state "$W/state/joint" --minutes "${JOINT_MIN:-8.5}" \
        --sessions "${SESSIONS:-8}" --switch "${SWITCH:-0.35}" \
        --first-phase-weight "${FIRST_WEIGHT:-1}" --self-commit "${SELF_COMMIT:-0}" \
        --sink-gap "${SINK_GAP:-0}" --served-from "${SERVED_FROM:-0}" --sound-spread "${SOUND_SPREAD:-0}" \
        --spread-requests "${SPREAD_REQUESTS:-2}" "${base_part[@]}" --lr "${LR:-1e-3}" \
        --workers "${JOINT_WORKERS:-10}" --log-every 5 --save-every 25 --export "$W/export/lora" \
        --export-base "$W/export/base" "${sessions[@]}" ${JOINT_STEPS:+--max-steps "$JOINT_STEPS"} \
        > "$W/logs/joint.log" 2>&1 || { decoders; return 1; }
    decoders || return 1
    stage "done"
}

# Put what an earlier call returned ($FROM: vae_root.tar, vae.tar or vae/ unpacked, dit.tar, base.state.pt,
# joint.state.pt, any of them) where the job finds it: a stage whose result is there is skipped, a trainer whose state is there resumes.
carry_in() {
    local f
    [ -f "$FROM/vae_root.tar" ] && tar -C "$W" -xf "$FROM/vae_root.tar"
    [ -f "$FROM/dit.tar" ] && tar -C "$W/export" -xf "$FROM/dit.tar"
    [ -f "$FROM/vae.tar" ] && tar -C "$W/export" -xf "$FROM/vae.tar"
    [ -d "$FROM/vae" ] && cp -r "$FROM/vae" "$W/export/"  # unpacked, as a run in progress keeps them in git
    if [ -f "$FROM/vae.tar" ] || [ -d "$FROM/vae" ]; then touch "$W/state/video_done" "$W/state/audio_done"; fi
    rm -rf "$W/export/base" "$W/export/lora"  # the student's exports are remade from its state
    for f in vae_video vae_audio base joint; do
        mkdir -p "$W/state/$f"
        if [ -f "$FROM/$f.state.pt" ]; then
            cp "$FROM/$f.state.pt" "$W/state/$f/state.pt"
        elif [ -f "$FROM/$f.state.pt.part00" ]; then
            cat "$FROM/$f.state.pt".part* > "$W/state/$f/state.pt"
        fi
    done
    return 0
}

case $cmd in
start)
    : "${ENCODER_ROOT:?set ENCODER_ROOT to the tiny MiniMax-H3 tree (text_encoder/, tokenizer/)}"
    if [ "${FROZEN_TEACHER:-0}" = 1 ] && { [ -n "${BASE_OWN_LOSS_ONLY:-}" ] || [ -n "${JOINT_OPENINGS:-}" ]; }; then
        echo "FROZEN_TEACHER=1 trains the base's video-only weights with the student's loss, not the base's own objective: BASE_OWN_LOSS_ONLY and JOINT_OPENINGS do not apply" >&2
        exit 2
    fi
    mkdir -p "$W/logs" "$W/state" "$W/export"
    rm -f "$W/done" "$W/progress"
    [ -n "${FROM:-}" ] && carry_in
    export PYTHONUNBUFFERED=1 W ENCODER_ROOT PY
    export -f job stage vaes_done train_vae decoder
    # the job's own output too goes to its log: a caller reading start's output must not wait for the job's end
    setsid bash -c 'job; echo $? > "$W/done"' > "$W/logs/job.log" 2>&1 < /dev/null &
    sleep 2
    cat "$W/progress" 2>/dev/null
    ;;
collect)
    : "${OUT:?set OUT to the results directory}"
    # a machine that idled out between calls comes back bare: say so at once instead of waiting WAIT for nothing
    [ -f "$W/logs/job.log" ] || { echo "no job was started in $W on this machine: start one (FROM= what the last call returned)" >&2; exit 3; }
    now=$(date +%s)
    end=$(( now + ${WAIT:-0} )) stop_at=$(( now + ${STOP_AFTER:-0} )) stop=${STOP:-}
    [ "$stop" = all ] && stop="vae_video vae_audio base joint"
    while [ ! -f "$W/done" ] && [ "$(date +%s)" -lt "$end" ]; do
        if [ -n "$stop" ] && [ "$(date +%s)" -ge "$stop_at" ]; then
            for s in $stop; do mkdir -p "$W/state/$s" && touch "$W/state/$s/stop"; done
            echo "$(date -u +%T) asked $stop to stop" | tee -a "$W/progress"
            stop=""
        fi
        sleep 5
    done
    cat "$W/progress"
    [ -f "$W/done" ] && echo "job exit $(cat "$W/done")"
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
    tail -n 2 "$W"/logs/*.log
    # at most 8 files, 16 MiB each and 64 MiB in all come back: stage 1's VAEs only until the final ones are done
    if vaes_done; then
        tar -C "$W/export" -cf "$OUT/vae.tar" vae
    elif [ -d "$W/vae_root" ]; then
        tar -C "$W" -cf "$OUT/vae_root.tar" vae_root
    fi
    dit=$(cd "$W/export" && ls -d base_stage2 base lora 2>/dev/null)
    [ -n "$dit" ] && tar -C "$W/export" -cf "$OUT/dit.tar" $dit
    tar -C "$W" -cf "$OUT/logs.tar" logs progress $(cd "$W" && ls state/*/log.jsonl 2>/dev/null)
    # the trainers' states: the base's (also once it exported, so that a later run can train the base on before its
    # student), the student's; the VAEs' (24-29 MB, in parts under 16 MiB) both while stage 1 runs, then the video
    # decoder's alone (the long pole) until it exported. A call that carries stage 1's VAEs without a decoder's
    # state takes stage 1's of that kind as final.
    cp "$W/state/base/state.pt" "$OUT/base.state.pt" 2>/dev/null
    [ -f "$W/state/joint/state.pt" ] && cp "$W/state/joint/state.pt" "$OUT/joint.state.pt"
    kinds="vae_video vae_audio"
    [ -d "$W/vae_root" ] && kinds=vae_video
    [ -f "$W/state/video_done" ] && kinds=""
    for s in $kinds; do
        [ -f "$W/state/$s/state.pt" ] && split -d -b 15M "$W/state/$s/state.pt" "$OUT/$s.state.pt.part"
    done
    ls -la "$OUT"
    ;;
*)
    echo "usage: $0 start|collect" >&2
    exit 2
    ;;
esac

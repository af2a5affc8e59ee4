"""The from-scratch training job (tools/train/run_from_scratch_gpu.sh) decides which trainer runs, from what and in
what order, and what comes back. These tests run the real script with PY set to a stand-in interpreter that
records each trainer call (its module and arguments, and the bytes of the state it was handed) and writes what
that trainer would leave behind, so the script's decisions are checked in a second, not in the GPU's 25 minutes:
a fresh job runs every stage in order; a call that carries an earlier call's results skips the stages they
finish and hands each trainer its state; the VAEs' states come back in parts that fit a returned file and rejoin
to the same bytes."""

import hashlib
import json
import os
import stat
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "train" / "run_from_scratch_gpu.sh"
PART_LIMIT = 16 * 1024 * 1024  # what one returned file may hold

# The stand-in: `PY -m tools.train.<trainer> ...`. It logs the call, then behaves as the trainer would on disk:
# a resumed state is kept, a new one is written (STATE_MB of bytes for a VAE), --export gets the trainer's layout;
# a trainer named in FAIL (vae:dec: the decoders alone) exits 1 after saving its state; one named in HOLD trains
# until a file `stop` appears in its state directory (at most 30 s), takes it away and records that it stopped.
STAND_IN = r'''#!{python}
import hashlib, json, os, sys, time
from pathlib import Path
args = sys.argv[1:]
module = args[1]
opts = {{}}
for i, a in enumerate(args):
    if a.startswith("--"):
        opts[a] = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else True
trainer = module.rsplit(".", 1)[1]
state = Path(opts["--state"]) / "state.pt"
handed = hashlib.sha256(state.read_bytes()).hexdigest() if state.is_file() else None
with open(os.environ["CALLS"], "a") as log:
    log.write(json.dumps({{"trainer": trainer, "kind": opts.get("--kind"), "freeze": "--freeze-encoder" in opts,
                          "handed": handed, "opts": opts}}) + "\n")
state.parent.mkdir(parents=True, exist_ok=True)
if handed is None:
    size = int(float(os.environ.get("STATE_MB", "1")) * 1024 * 1024) if trainer == "vae" else 4096
    state.write_bytes(os.urandom(size))
if trainer in os.environ.get("HOLD", "").split(","):
    stop, waited = state.parent / "stop", 0.0
    while not stop.exists() and waited < 30:
        time.sleep(0.1)
        waited += 0.1
    with open(os.environ["CALLS"], "a") as log:
        log.write(json.dumps({{"trainer": trainer, "stopped": stop.exists(), "kind": None, "freeze": False}}) + "\n")
    stop.unlink(missing_ok=True)
if {{trainer, trainer + (":dec" if "--freeze-encoder" in opts else "")}} & set(os.environ.get("FAIL", "").split(",")):
    sys.exit(1)  # a crash after the state was saved, before the export
for key in ("--export", "--export-base"):
    if key in opts:
        out = Path(opts[key])
        if trainer == "vae":
            out = out / ("vae" if opts["--kind"] == "video" else "audio_vae")
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(trainer)
'''


def _stand_in(tmp_path: Path) -> Path:
    path = tmp_path / "fake_python"
    path.write_text(STAND_IN.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _run(tmp_path: Path, name: str, **env: str) -> tuple[list[dict], Path, str]:
    """Start the job and collect it once it ends; returns (trainer calls, the results folder, collect's output)."""
    work, out = tmp_path / name, tmp_path / f"{name}_out"
    out.mkdir()
    calls = tmp_path / f"{name}_calls.jsonl"
    base = {**os.environ, "W": str(work), "ENCODER_ROOT": str(tmp_path / "enc"), "PY": str(_stand_in(tmp_path)),
            "CALLS": str(calls), **env}
    subprocess.run(["bash", str(SCRIPT), "start"], env=base, check=True, capture_output=True, timeout=60)
    done = subprocess.run(["bash", str(SCRIPT), "collect"], env={**base, "OUT": str(out), "WAIT": "60"},
                          check=True, capture_output=True, text=True, timeout=120)
    lines = calls.read_text().splitlines() if calls.exists() else []
    return [json.loads(line) for line in lines], out, done.stdout


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _steps(calls: list[dict]) -> list[str]:
    return [c["trainer"] + (f":{c['kind']}" if c["kind"] else "") + (":dec" if c["freeze"] else "") for c in calls]


def test_a_fresh_job_trains_every_stage_in_order_and_returns_every_result(tmp_path):
    calls, out, log = _run(tmp_path, "fresh")
    steps = _steps(calls)
    assert sorted(steps[:2]) == ["vae:audio", "vae:video"]  # stage 1, side by side
    # stage 2 side by side, then the student once the base is done (the decoders may still run beside it)
    assert sorted(steps[2:]) == ["dit", "student", "vae:audio:dec", "vae:video:dec"]
    assert steps.index("student") > steps.index("dit")
    assert all(c["handed"] is None for c in calls[:2])
    by_step = dict(zip(steps, calls))
    assert by_step["vae:video:dec"]["handed"] and by_step["vae:audio:dec"]["handed"]  # on from stage 1's states
    assert by_step["dit"]["handed"] is None
    dit, student = by_step["dit"]["opts"], by_step["student"]["opts"]
    # the frozen encoder's outputs are kept where the data recurs: the video decoder's windows, the base's seeds
    assert by_step["vae:video:dec"]["opts"]["--distinct"] == "8192" and dit["--distinct"] == "4096"
    assert "--distinct" not in by_step["vae:audio:dec"]["opts"] and "--distinct" not in student
    assert student["--switch"] == "0.35"
    assert dit["--vae-root"].endswith("/vae_root") and student["--vae-root"].endswith("/vae_root")
    assert student["--base"].endswith("export/base_stage2/FL2VA/transformer")
    assert "job exit 0" in log
    # the VAEs are done: their states and stage 1's VAEs stay behind; the base's state comes back although it
    # exported, so that a later call can train the base on before a new student (the next test)
    assert {p.name for p in out.iterdir()} == {"vae.tar", "dit.tar", "logs.tar", "base.state.pt", "joint.state.pt"}
    assert _sha(out / "base.state.pt") == _sha(tmp_path / "fresh" / "state" / "base" / "state.pt")
    with tarfile.open(out / "vae.tar") as tar:
        assert {"vae/vae/config.json", "vae/audio_vae/config.json"} <= set(tar.getnames())
    with tarfile.open(out / "dit.tar") as tar:
        assert {n.split("/")[0] for n in tar.getnames()} == {"base_stage2", "base", "lora"}


def test_a_recipe_pinned_in_steps_ends_the_base_and_the_student_at_those_steps_and_serves_from_its_step(tmp_path):
    calls, _, log = _run(tmp_path, "pinned", BASE_STEPS="4698", JOINT_STEPS="1607", SERVED_FROM="468",
                         SOUND_SPREAD="48", SPREAD_REQUESTS="1", BASE_OWN_LOSS_ONLY="1")
    by_step = dict(zip(_steps(calls), calls))
    assert by_step["dit"]["opts"]["--max-steps"] == "4698"
    assert by_step["student"]["opts"]["--max-steps"] == "1607"
    assert by_step["student"]["opts"]["--served-from"] == "468"
    assert by_step["student"]["opts"]["--sound-spread"] == "48"
    assert by_step["student"]["opts"]["--spread-requests"] == "1"
    assert by_step["student"]["opts"]["--base-own-loss-only"] is True
    assert "job exit 0" in log
    calls, _, _ = _run(tmp_path, "unpinned")
    assert not any("--max-steps" in c["opts"] for c in calls)  # by minutes alone
    student_opts = dict(zip(_steps(calls), calls))["student"]["opts"]
    assert (student_opts["--served-from"], student_opts["--sound-spread"], student_opts["--spread-requests"]) == (
        "0", "0", "2")
    assert "--base-own-loss-only" not in student_opts  # the student's loss trains the base part too
    assert student_opts["--train-base"] is True and student_opts["--export-base"].endswith("export/base")


def test_a_frozen_teacher_student_trains_its_lora_and_the_video_weights_and_returns_that_base(tmp_path):
    calls, out, log = _run(tmp_path, "frozen", FROZEN_TEACHER="1", JOINT_STEPS="3214")
    student = dict(zip(_steps(calls), calls))["student"]["opts"]
    assert "job exit 0" in log
    assert student["--video-weights"] is True
    assert not {"--train-base", "--openings", "--base-own-loss-only"} & set(student)
    assert student["--max-steps"] == "3214" and student["--export-base"].endswith("export/base")
    with tarfile.open(out / "dit.tar") as tar:
        assert {n.split("/")[0] for n in tar.getnames()} == {"base_stage2", "base", "lora"}


@pytest.mark.parametrize("knob", [{"BASE_OWN_LOSS_ONLY": "1"}, {"JOINT_OPENINGS": "0.5"}])
def test_a_frozen_teacher_with_a_knob_of_the_bases_own_objective_is_refused_before_any_job_starts(tmp_path, knob):
    work = tmp_path / "w"
    env = {**os.environ, "W": str(work), "ENCODER_ROOT": str(tmp_path / "enc"), "PY": str(_stand_in(tmp_path)),
           "CALLS": str(tmp_path / "calls.jsonl"), "FROZEN_TEACHER": "1", **knob}
    done = subprocess.run(["bash", str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert next(iter(knob)) in done.stderr and "FROZEN_TEACHER=1" in done.stderr
    assert not (work / "logs" / "job.log").exists() and not (tmp_path / "calls.jsonl").exists()


def test_a_call_carrying_the_final_vaes_and_the_base_state_resumes_the_base_and_trains_no_vae(tmp_path):
    _, first, _ = _run(tmp_path, "first", FAIL="dit")  # the base fails before it exports: its state stays
    (tmp_path / "first_out" / "base.state.pt").write_bytes(b"base state at step 300")
    calls, out, log = _run(tmp_path, "second", FROM=str(first))
    assert _steps(calls) == ["dit", "student"]
    assert calls[0]["handed"] == _sha(first / "base.state.pt")
    assert calls[0]["opts"]["--vae-root"].endswith("export/vae")  # the final VAEs define the latents now
    assert "job exit 0" in log and (out / "vae.tar").is_file()


def test_the_vae_states_come_back_in_parts_under_the_file_limit_and_a_later_call_resumes_from_them(tmp_path):
    _, first, log = _run(tmp_path, "first", FAIL="vae", STATE_MB="20")  # the VAEs fail: nothing exported
    assert "job exit 1" in log
    parts = sorted(first.glob("vae_video.state.pt.part*"))
    assert len(parts) == 2 and all(p.stat().st_size <= PART_LIMIT for p in parts)
    video = b"".join(p.read_bytes() for p in parts)
    assert len(video) == 20 * 1024 * 1024
    assert not (first / "vae.tar").exists() and not (first / "vae_root.tar").exists()

    calls, _, log = _run(tmp_path, "second", FROM=str(first))
    assert sorted(_steps(calls)[:2]) == ["vae:audio", "vae:video"]  # stage 1 again, from its states
    handed = {c["kind"]: c["handed"] for c in calls[:2]}
    assert len(calls) == 6
    assert handed["video"] == hashlib.sha256(video).hexdigest()
    assert handed["audio"] is not None and "job exit 0" in log


def test_a_lost_stage_2_returns_stage_1s_vaes_and_the_video_decoders_state_and_the_next_call_resumes_it(tmp_path):
    _, first, log = _run(tmp_path, "first", FAIL="vae:dec,dit", STATE_MB="20")
    assert "job exit 1" in log
    files = list(first.iterdir())
    assert {p.name for p in files} == {"vae_root.tar", "base.state.pt", "logs.tar", "vae_video.state.pt.part00",
                                       "vae_video.state.pt.part01"}  # the audio decoder's state stays behind
    assert len(files) <= 8 and sum(p.stat().st_size for p in files) <= 64 * 1024 * 1024
    video = b"".join(p.read_bytes() for p in sorted(first.glob("vae_video.state.pt.part*")))

    calls, out, log = _run(tmp_path, "second", FROM=str(first))
    steps = _steps(calls)
    assert sorted(steps) == ["dit", "student", "vae:video:dec"] and steps.index("student") > steps.index("dit")
    by_step = dict(zip(steps, calls))
    assert by_step["vae:video:dec"]["handed"] == hashlib.sha256(video).hexdigest()
    assert by_step["dit"]["handed"] == _sha(first / "base.state.pt")
    assert by_step["dit"]["opts"]["--vae-root"].endswith("/vae_root")  # the latents stay stage 1's
    assert "job exit 0" in log
    with tarfile.open(out / "vae.tar") as tar:  # the video decoder trained on, stage 1's audio VAE taken as final
        assert {"vae/vae/config.json", "vae/audio_vae/config.json"} <= set(tar.getnames())


def test_a_collect_asked_to_stop_the_base_ends_it_and_the_job_goes_on_to_the_student(tmp_path):
    calls, out, log = _run(tmp_path, "stopped", HOLD="dit", STOP="base", STOP_AFTER="1")
    held = [c for c in calls if "stopped" in c]
    assert held == [{"trainer": "dit", "stopped": True, "kind": None, "freeze": False}]
    assert _steps(calls)[-1] == "student" and "job exit 0" in log
    assert "asked base to stop" in log
    assert not (tmp_path / "stopped" / "state" / "base" / "stop").exists()  # taken: a resumed base trains on
    with tarfile.open(out / "dit.tar") as tar:
        assert {n.split("/")[0] for n in tar.getnames()} == {"base_stage2", "base", "lora"}


def test_a_call_carrying_the_base_export_and_the_students_state_trains_the_student_alone_at_the_asked_switch(tmp_path):
    _, first, _ = _run(tmp_path, "first")
    (first / "joint.state.pt").write_bytes(b"student state at step 180")
    calls, out, log = _run(tmp_path, "second", FROM=str(first), SWITCH="0.7")
    assert _steps(calls) == ["student"]  # the VAEs and the base are done: only the student trains on
    assert calls[0]["handed"] == _sha(first / "joint.state.pt")
    assert calls[0]["opts"]["--switch"] == "0.7"
    assert calls[0]["opts"]["--base"].endswith("export/base_stage2/FL2VA/transformer")
    assert "job exit 0" in log
    with tarfile.open(out / "dit.tar") as tar:  # the student's exports are made anew from its state
        assert {n.split("/")[0] for n in tar.getnames()} == {"base_stage2", "base", "lora"}


def test_a_student_asked_for_distinct_sessions_trains_on_that_many_and_its_sessions_at_the_asked_size(tmp_path):
    _, first, _ = _run(tmp_path, "first")
    calls, _, log = _run(tmp_path, "second", FROM=str(first), JOINT_DISTINCT="4096", SESSIONS="16")
    assert _steps(calls) == ["student"] and "job exit 0" in log
    assert calls[0]["opts"]["--distinct"] == "4096" and calls[0]["opts"]["--sessions"] == "16"


def test_a_collect_on_a_machine_with_no_job_says_so_at_once_instead_of_waiting(tmp_path):
    # a machine that idled out between calls comes back bare: its collect must not spend the call's WAIT
    env = {**os.environ, "W": str(tmp_path / "w"), "OUT": str(tmp_path / "out"), "WAIT": "600"}
    started = time.monotonic()
    done = subprocess.run(["bash", str(SCRIPT), "collect"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert "no job was started" in done.stderr
    assert time.monotonic() - started < 30

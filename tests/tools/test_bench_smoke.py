"""`python -m tools.bench` runs end to end on the tiny preset on the CPU and prints its report."""
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# every case runs a bench (as a subprocess, or its ranks as processes): the slow tier
pytestmark = pytest.mark.e2e


@pytest.mark.cpu
def test_bench_runs_on_the_tiny_preset():
    run = subprocess.run([sys.executable, "-m", "tools.bench", "--preset", "tiny", "--devices", "cpu",
                          "--width", "320", "--height", "192", "--requests", "2", "--prompt-tokens", "40"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "time to first chunk" in out and "(warm: a second session)" in out
    for k in (0, 1):
        row = next(line for line in out.splitlines() if line.strip().startswith(f"{k} |"))
        cells = [c.strip() for c in row.split("|")]
        # DiT seconds, the VAE process's video decode and mux, and the delivery interval were all measured
        assert float(cells[1]) > 0 and float(cells[6]) > 0 and float(cells[8]) > 0 and float(cells[9]) > 0
    assert "steady state (requests 1..1)" in out
    # both sessions' first chunks were logged as they came, with the figures the summary prints
    logged = re.findall(r"time to first chunk (\d+\.\d+) s", run.stderr)
    summary = re.search(r"teacher: (\d+\.\d+) s \(first session after start-up\), (\d+\.\d+) s \(warm", out)
    assert logged == list(summary.groups())
    # where each first chunk went: the stages ran one after another, so they cannot add up to more than it took
    for which, ttfc in zip(("cold", "warm"), summary.groups()):
        line = next(x for x in out.splitlines() if x.startswith(f"first chunk, {which}: "))
        stages = re.sub(r"\([^)]*\)", "", line.split(": ", 1)[1])  # without the DiT's own parts
        parts = {name: float(sec) for name, sec in re.findall(r"(\w+) (-?\d+\.\d+)", stages)}
        assert float(line.rsplit("= ", 1)[1].removesuffix(" s")) == float(ttfc)
        assert min(parts[k] for k in ("encode", "open", "dit", "hand_over", "video_decode", "mux")) > 0, line
        assert parts["waiting"] > -0.002, line


@pytest.mark.cpu
def test_bench_without_the_vae_counts_delivery_at_the_dit():
    run = subprocess.run([sys.executable, "-m", "tools.bench", "--preset", "tiny", "--devices", "cpu",
                          "--width", "320", "--height", "192", "--requests", "3", "--prompt-tokens", "40",
                          "--no-vae", "--merge-lora", "--trace-request", "2"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no VAE (--no-vae)" in run.stdout and "merge_lora=True" in run.stdout
    assert "request 2 traced" in run.stdout and "no GPU kernels recorded" in run.stdout  # a CPU run
    assert "steady state (requests 1..1, before the traced one)" in run.stdout  # its stall is left out
    row = next(line for line in run.stdout.splitlines() if line.strip().startswith("1 |"))
    cells = [c.strip() for c in row.split("|")]
    assert float(cells[6]) == 0 and float(cells[1]) > 0 and float(cells[9]) > 0  # no decode; DiT and delivery


@pytest.mark.cpu
def test_bench_takes_its_options_from_a_profile():
    from tools.bench import PROFILE_OPTIONS, profile_options
    from services.common.config import load_profile

    usp2 = profile_options(load_profile(ROOT / "configs" / "usp2_fp8.yaml"))
    assert set(usp2) == set(PROFILE_OPTIONS)
    assert usp2 == dict(preset="full", devices="cuda:0,cuda:1", width=864, height=480, max_tokens=512, fp8=True,
                        adaln_cache=True, cuda_graphs=True, prompt_buckets="128,256,384,512", attention="fa4",
                        merge_lora=False, teacher_sharded=False, teacher_overlap=True, teacher_staged=True,
                        reuse_text_kv=True,
                        tile_overlap=32, vae_tile_devices="cuda:0", vae_compile=True, vae_graphs=True, window=2)
    usp2_vae_on_0 = load_profile(ROOT / "configs" / "usp2_fp8.yaml", {"vae": {"device": "cuda:0", "tile_devices": []}})
    with pytest.raises(ValueError, match="the VAE on the last .*puts them on cuda:0 and cuda:0"):
        profile_options(usp2_vae_on_0)
    run = subprocess.run([sys.executable, "-m", "tools.bench", "--profile", "configs/tiny_cpu.yaml",
                          "--requests", "1", "--prompt-tokens", "40", "--no-vae"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("canvas 320x192, 1 requests, fp8=False")  # the profile's default canvas
    assert run.stdout.rstrip().endswith("GPU memory the profile's stages declare (memory_gib, all stages on a GPU "
                                        "together): none")  # a CPU profile declares no GPU shares
    clash = subprocess.run([sys.executable, "-m", "tools.bench", "--profile", "configs/tiny_cpu.yaml", "--fp8"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert clash.returncode == 2 and "--profile sets --fp8 itself" in clash.stderr



@pytest.mark.cpu
def test_all_to_all_bench_times_both_exchanges_of_every_row_count():
    from tools.dit.bench_all_to_all import measure

    measured = measure(2, "cpu", "tiny", [64, 128], iters=2)
    assert [(m.rows, m.name) for m in measured] == [(64, "q, k, v"), (64, "output"), (128, "q, k, v"), (128, "output")]
    # tiny: 2 of 4 heads per rank, head dim 32, BF16; half of each buffer crosses to the other rank
    assert [m.crossing_bytes for m in measured] == [64 * 3 * 2 * 32 * 2, 64 * 2 * 32 * 2,
                                                    128 * 3 * 2 * 32 * 2, 128 * 2 * 32 * 2]
    assert all(m.seconds > 0 for m in measured)


@pytest.mark.cpu
def test_the_one_gpu_baseline_profile_drops_the_teacher_options_a_single_rank_cannot_have():
    import dataclasses

    import torch

    from services.common.config import load_profile
    from tools.bench import baseline_profile

    usp2 = load_profile(ROOT / "configs" / "usp2_fp8.yaml")
    overlapping = dataclasses.replace(usp2, dit=dataclasses.replace(usp2.dit, teacher_overlap=True,
                                                                    teacher_sharded=False))
    for profile in (usp2, overlapping):  # --teacher-overlap --baseline crashed here after the session
        single = baseline_profile(profile, torch.device("cuda:0"))
        assert single.dit.devices == ("cuda:0",) and not single.dit.cuda_graphs
        assert not (single.dit.teacher_overlap or single.dit.teacher_sharded or single.dit.teacher_staged)
        assert (single.dit.fp8, single.dit.adaln_cache) == (profile.dit.fp8, profile.dit.adaln_cache)

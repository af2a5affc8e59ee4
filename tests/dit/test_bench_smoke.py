"""`python -m services.bench` runs end to end on the tiny preset on the CPU and prints its report."""
import re
import subprocess
import sys

import pytest


@pytest.mark.cpu
def test_bench_runs_on_the_tiny_preset():
    run = subprocess.run([sys.executable, "-m", "services.bench", "--preset", "tiny", "--devices", "cpu",
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


@pytest.mark.cpu
def test_bench_without_the_vae_counts_delivery_at_the_dit():
    run = subprocess.run([sys.executable, "-m", "services.bench", "--preset", "tiny", "--devices", "cpu",
                          "--width", "320", "--height", "192", "--requests", "2", "--prompt-tokens", "40",
                          "--no-vae", "--merge-lora"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no VAE (--no-vae)" in run.stdout and "merge_lora=True" in run.stdout
    row = next(line for line in run.stdout.splitlines() if line.strip().startswith("1 |"))
    cells = [c.strip() for c in row.split("|")]
    assert float(cells[6]) == 0 and float(cells[1]) > 0 and float(cells[9]) > 0  # no decode; DiT and delivery

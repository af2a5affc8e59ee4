"""SIGTERM while `services.up` is still starting the stages stops the children it already started."""
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.e2e]
ROOT = pathlib.Path(__file__).resolve().parents[2]

# Runs services.up.main() with the stage commands replaced by sleepers that never become healthy.
_DRIVER = textwrap.dedent("""
    import dataclasses, subprocess, sys
    import services.up as up

    real_popen = subprocess.Popen

    def sleeper(cmd, *args, **kwargs):
        proc = real_popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(proc.pid, flush=True)
        return proc

    real_load = up.load_profile
    up.load_profile = lambda path: dataclasses.replace(
        real_load(path), model=dataclasses.replace(real_load(path).model, write_if_missing=False))
    up.check_ports_free = lambda profile: None
    up.check = lambda *args, **kwargs: False
    subprocess.Popen = sleeper
    sys.argv = ["services.up", "--profile", "configs/tiny_cpu.yaml"]
    sys.exit(up.main())
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a killed child nobody reaped yet is not running
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_sigterm_during_start_up_stops_the_started_stages():
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        while len(pids) < 3:
            line = driver.stdout.readline()
            assert line, "the driver exited before starting the three stages"
            pids.append(int(line))
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "stage processes outlived services.up after SIGTERM"
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if driver.poll() is None:
            driver.kill()

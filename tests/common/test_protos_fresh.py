"""The committed gRPC stubs match protos/ (CI fails when someone edits a .proto without regenerating)."""
import subprocess
import sys
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.cpu
def test_generated_stubs_are_fresh():
    run = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr

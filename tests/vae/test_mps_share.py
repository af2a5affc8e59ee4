"""`vae.mps_sm_percent`: the VAE process asks the MPS server for a share of each GPU's SMs before CUDA starts."""
import subprocess
import sys
import textwrap

import pytest

from services.common.config import VAEConfig


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


@pytest.mark.cpu
def test_the_limit_reaches_the_environment_mps_reads_and_100_sets_nothing():
    done = run("""
        import os
        from services.vae.service import limit_mps_sm_share
        os.environ.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)
        limit_mps_sm_share(100)
        print(os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"))
        limit_mps_sm_share(40)
        print(os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"))
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["None", "40"]


@pytest.mark.gpu
def test_a_limit_after_cuda_started_is_refused():
    pytest.importorskip("torch").cuda.is_available() or pytest.skip("needs a CUDA GPU")
    done = run("""
        import torch
        from services.vae.service import limit_mps_sm_share
        torch.zeros(1, device="cuda")
        limit_mps_sm_share(40)
    """)
    assert done.returncode != 0 and "CUDA already started in this process" in done.stderr


@pytest.mark.cpu
@pytest.mark.parametrize("bad", [0, 101, 50.0, "half"])
def test_the_share_must_be_a_whole_percent(bad):
    with pytest.raises(ValueError, match=f"vae.mps_sm_percent={bad!r}: must be a whole number from 1 to 100"):
        VAEConfig(mps_sm_percent=bad)

"""The gateway process never imports torch (it forwards tensors as opaque protobuf parts)."""
import subprocess
import sys

import pytest


@pytest.mark.cpu
def test_gateway_imports_no_torch():
    code = ("import sys, services.gateway.__main__, services.gateway.ws, services.gateway.grpc_pipeline, "
            "services.client; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'diffusers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout

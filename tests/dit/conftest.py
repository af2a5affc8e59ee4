"""Fixtures shared by the DiT tests (the factories behind them are in tests/dit/factories.py)."""
import pytest

from tests.dit.factories import tiny_adapter


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """A random tiny LoRA adapter (seed 1), written once per test module."""
    return tiny_adapter(tmp_path_factory.mktemp("lora"))

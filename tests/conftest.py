"""Test tiers: every test carries exactly one of the markers cpu, gpu, multi_gpu, images.

GPU tiers are skipped cleanly on machines without enough CUDA devices; the images tier (tests/images: builds and
runs the container images) skips itself where podman cannot run, unless VITASCOPE_IMAGES_REQUIRED=1.
"""
import pytest

TIERS = ("cpu", "gpu", "multi_gpu", "images")


def _cuda_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    cuda = _cuda_count()
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t) is not None]
        if len(tiers) != 1:
            raise pytest.UsageError(
                f"{item.nodeid}: needs exactly one tier marker of {TIERS}, has {tiers or 'none'}"
            )
        if tiers[0] == "gpu" and cuda < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if tiers[0] == "multi_gpu" and cuda < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))

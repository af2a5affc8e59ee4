"""`python -m tools.dit.bench_lora_kernels`: the row counts it times are the streaming forwards' own, and each
figure times every call it replays."""
import pytest
import torch

pytest.importorskip("triton")

from tools.dit.bench_lora_kernels import replayed_seconds, streaming_shapes  # noqa: E402


@pytest.mark.cpu
def test_shapes_are_a_phases_media_rows_per_rank():
    shapes = {s.name: s for s in streaming_shapes()}
    steady = 10 * 15 * 27 + 2 * 56  # 10 latent frames of 15 x 27 rows, two audio channels of 56 latents
    assert (shapes["10 latents, one GPU"].rows, shapes["10 latents, one GPU"].groups) == (steady, 1)
    assert (shapes["10 latents, USP2 rank"].rows, shapes["10 latents, USP2 rank"].groups) == (steady // 2, 2)
    assert shapes["5 latents, USP2 rank"].rows == (5 * 405 + 2 * 28) // 2 + (5 * 405 + 2 * 28) % 2
    assert shapes["teacher, USP2 rank"].rows == 352


@pytest.mark.gpu
def test_replayed_seconds_times_every_call_of_every_replay():
    """One warm-up call, then `runs` + 1 replays of `calls` back-to-back calls: a counter the call bumps on the GPU
    shows each of them ran (capturing runs nothing)."""
    counter = torch.zeros((), device="cuda", dtype=torch.int64)
    seconds = replayed_seconds(lambda: counter.add_(1), calls=5, runs=3)
    assert int(counter) == 1 + 5 * (3 + 1)
    assert 0 < seconds < 1e-3

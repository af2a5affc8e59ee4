"""`python -m services.dit.bench_lora_kernels`: the row counts it times are the streaming forwards' own."""
import pytest

pytest.importorskip("triton")

from services.dit.bench_lora_kernels import streaming_shapes  # noqa: E402


@pytest.mark.cpu
def test_shapes_are_a_phases_media_rows_per_rank():
    shapes = {s.name: s for s in streaming_shapes()}
    steady = 10 * 15 * 27 + 2 * 56  # 10 latent frames of 15 x 27 rows, two audio channels of 56 latents
    assert (shapes["10 latents, one GPU"].rows, shapes["10 latents, one GPU"].groups) == (steady, 1)
    assert (shapes["10 latents, USP2 rank"].rows, shapes["10 latents, USP2 rank"].groups) == (steady // 2, 2)
    assert shapes["5 latents, USP2 rank"].rows == (5 * 405 + 2 * 28) // 2 + (5 * 405 + 2 * 28) % 2
    assert shapes["teacher, USP2 rank"].rows == 352

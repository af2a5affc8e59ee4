"""`python -m tools.dit.bench_attention`: the shapes it times are the streaming forwards' own."""
import pytest

from tools.dit.bench_attention import streaming_shapes
from services.dit.model.network import PRESETS


@pytest.mark.cpu
def test_shapes_are_the_phases_media_rows_over_history_media_and_text():
    shapes = {s.name: s for s in streaming_shapes(text_rows=400, history_rows=13000)}
    steady = shapes["10 latents, USP2 rank"]
    assert steady.q_rows == 10 * 15 * 27 + 2 * 56  # 10 latent frames of 15 x 27 rows, two audio channels
    assert steady.k_rows == 13000 + steady.q_rows + 400
    assert (steady.heads, shapes["10 latents, one GPU"].heads) == (28, 56)
    assert shapes["5 latents, USP2 rank"].q_rows == 5 * 405 + 2 * 28
    first = shapes["12 latents, one GPU"]  # a session's first phase: no history yet
    assert first.k_rows == first.q_rows + 400 and first.q_rows == 12 * 405 + 2 * 65
    assert steady.flops == 4 * steady.q_rows * steady.k_rows * 28 * PRESETS["full"].head_dim

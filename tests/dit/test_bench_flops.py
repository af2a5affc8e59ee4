"""The bench counts the FLOPs each DiT forward executes: a forward that takes recorded text K/V
(`dit.reuse_text_kv`) counts its media rows' attention to them, but no text rows."""

import pytest

from services.bench import FlopCounter
from services.dit.model import PRESETS

pytestmark = pytest.mark.cpu


def test_a_forward_on_recorded_text_kv_drops_exactly_the_text_rows_work():
    args, text, media, history = PRESETS["full"], 380, 4162, 13000
    with_text, reused = FlopCounter(args, lora_rank=128), FlopCounter(args, lora_rank=128)
    with_text.add(text, text + media, history, full=False)
    reused.add(0, media, history, full=False, text_keys=text)
    (lin_t, att_t), (lin_r, att_r) = with_text.take(), reused.take()
    blocks = args.num_layers + args.refiner_layers
    assert lin_t - lin_r == with_text.per_row_linear() * blocks * text  # the text rows through every block
    assert att_t - att_r == 4.0 * args.head_dim * args.num_heads * blocks * text * text  # their text-only attention
    assert 0.04 < (lin_t + att_t - lin_r - att_r) / (lin_t + att_t) < 0.07  # ~5% of a 10-latent phase forward

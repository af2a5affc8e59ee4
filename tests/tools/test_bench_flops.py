"""The bench counts the FLOPs each DiT forward executes: a forward that takes recorded text K/V
(`dit.reuse_text_kv`) counts its media rows' attention to them, but no text rows; a forward whose text is padded to a
bucket counts its real rows."""

from dataclasses import replace

import pytest
import torch

from tools.bench import FlopCounter
from services.dit.stream.attention import StreamingAttention
from services.dit.stream.kv_cache import CleanAVKVCache
from services.dit.model.layout import pack_layout
from services.dit.model.network import PRESETS

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


def test_a_student_with_its_text_padded_to_a_bucket_counts_the_real_rows():
    args = PRESETS["tiny"]
    cache = CleanAVKVCache(args.num_layers, 256, local_heads=args.num_heads, head_dim=args.head_dim,
                           dtype=torch.float32, device="cpu")

    def count(text_len: int, real: int) -> tuple[float, float]:
        layout = pack_layout(text_len=text_len, audio_len_per_channel=3, video_rows=20,
                             positions_text=torch.zeros(text_len, 3), positions_audio=torch.zeros(6, 3),
                             positions_video=torch.zeros(20, 3), video_t=0.5, audio_t=0.5)
        if real != text_len:
            layout = replace(layout, text_valid=torch.arange(text_len) < real)
        counter = FlopCounter(args, lora_rank=4)
        counter.hook(None, (None, None, None, layout, StreamingAttention(layout, cache, record=True)), {})
        return counter.take()

    exact, padded = count(5, 5), count(16, 5)
    assert exact == padded and exact[0] > 0

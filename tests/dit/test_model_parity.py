"""DiT model parity with diffusers' MiniMaxH3Transformer3DModel, grouped-QKV load, layout and AdaLN cache (tiny, CPU)."""

import pytest
import torch

from services.dit.model.adaln_cache import AdaLNCacheError
from services.dit.model.checkpoint import load_dit, write_random_checkpoint
from services.dit.model.layout import PAD_MULTIPLE, TAG_AUDIO, TAG_PAD, TAG_TEXT, TAG_VIDEO, pack_layout
from services.dit.model.network import FullAttention
from tests.dit.factories import TINY, tiny_model

pytestmark = pytest.mark.cpu

TT, AL, TV = 9, 6, 32  # text rows, audio rows per channel, video rows: 9 + 12 + 32 = 53 real rows, 11 pad


def _layout(video_t=0.25, audio_t=0.6, **kw):
    g = torch.Generator().manual_seed(1)
    pos_t = torch.stack([torch.arange(TT, dtype=torch.float32), torch.zeros(TT), torch.zeros(TT)], 1)
    pos_a = torch.cat([torch.arange(AL).float()[:, None] + TT, torch.zeros(AL, 1), torch.zeros(AL, 1)], 1)
    pos_a = torch.cat([pos_a, pos_a + torch.tensor([0.0, 0.0, 3.0])], 0)
    pos_v = torch.rand(TV, 3, generator=g) * torch.tensor([20.0, 8.0, 8.0]) + TT
    args = dict(text_len=TT, audio_len_per_channel=AL, video_rows=TV, positions_text=pos_t,
                positions_audio=pos_a, positions_video=pos_v, video_t=video_t)
    if "audio_timesteps" not in kw:
        args["audio_t"] = audio_t
    args.update(kw)
    return pack_layout(**args)


def _inputs(seed=2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(TV, TINY.video_row_dim, generator=g), torch.randn(2 * AL, TINY.audio_channels, generator=g),
            torch.randn(TT, TINY.text_dim, generator=g))


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("dit")
    return {lay: write_random_checkpoint(TINY, root / lay, lay, seed=7) for lay in ("original", "diffusers")}


def _diffusers_run(model, layout, video, audio, text):
    n = layout.num_real  # diffusers has no padding: feed the real rows only
    out = model(hidden_states=video[None], audio_hidden_states=audio[None], encoder_hidden_states=text[None],
                timestep=layout.timesteps, timestep_indices=layout.timestep_slot[:n], token_tags=layout.tags[:n],
                position_ids=layout.positions[:n], video_indices=layout.video_index,
                audio_indices=layout.audio_index, text_indices=layout.text_index, return_dict=False)
    return out[0][0], out[1][0]


@torch.no_grad()
def test_parity_with_diffusers_on_padded_document(ckpts):
    from diffusers import MiniMaxH3Transformer3DModel

    ref = MiniMaxH3Transformer3DModel.from_pretrained(str(ckpts["diffusers"]), torch_dtype=torch.float32).eval()
    ours = load_dit(ckpts["diffusers"], TINY, "cpu", torch.float32)
    layout = _layout()
    assert layout.seq_len == 64 and layout.num_real == TT + 2 * AL + TV  # padding present
    video, audio, text = _inputs()
    v_ref, a_ref = _diffusers_run(ref, layout, video, audio, text)
    v, a = ours(video, audio, text, layout, FullAttention(layout))
    assert v.shape == (TV, 96) and a.shape == (2 * AL, 32)
    assert _rel(v, v_ref) < 1e-5 and _rel(a, a_ref) < 1e-5
    # The test can fail: a different audio timestep changes the answer well beyond the tolerance.
    v2, _ = ours(video, audio, text, _layout(audio_t=0.1), FullAttention(layout))
    assert _rel(v2, v_ref) > 1e-3


@torch.no_grad()
def test_original_layout_matches_diffusers_via_reference_conversion(ckpts):
    """Grouped [q_h, k_h, v_h] QKV: our loader equals diffusers' own 'interleaved' converter on the same files."""
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file

    raw = {}
    for f in sorted(ckpts["original"].glob("model-*.safetensors")):
        raw.update(load_file(str(f)))
    cfg = dict(num_attention_heads=TINY.num_heads, attention_head_dim=TINY.head_dim)
    converted = convert_minimax_h3_transformer_checkpoint_to_diffusers(raw, cfg, qkv_layout="interleaved")
    ref = MiniMaxH3Transformer3DModel(
        num_attention_heads=TINY.num_heads, attention_head_dim=TINY.head_dim, hidden_size=TINY.hidden_size,
        num_layers=TINY.num_layers, num_refiner_layers=TINY.refiner_layers, ffn_dim=TINY.ffn_hidden,
        text_dim=TINY.text_dim, time_embed_hidden_dim=TINY.time_embed_hidden, time_embed_dim=TINY.time_embed_dim,
        rope_freq_dim=TINY.rope_freqs).eval()
    ref.load_state_dict({k: v.float() for k, v in converted.items()}, strict=True)
    ours = load_dit(ckpts["original"], TINY, "cpu", torch.float32)
    layout = _layout()
    video, audio, text = _inputs(5)
    v_ref, a_ref = _diffusers_run(ref, layout, video, audio, text)
    v, a = ours(video, audio, text, layout, FullAttention(layout))
    assert _rel(v, v_ref) < 1e-5 and _rel(a, a_ref) < 1e-5
    # Both layouts of the same seed load to the identical model.
    other = load_dit(ckpts["diffusers"], TINY, "cpu", torch.float32).state_dict()
    for name, t in ours.state_dict().items():
        assert torch.equal(t, other[name]), name


def test_pack_layout_rows_tags_slots():
    layout = _layout(video_t=0.25, audio_timesteps=[1.0] * 3 + [0.6] * 3 + [1.0] * 3 + [0.6] * 3)
    s, real = layout.seq_len, layout.num_real
    assert s % PAD_MULTIPLE == 0 and s - real < PAD_MULTIPLE
    tags = layout.tags.tolist()
    assert tags == [TAG_TEXT] * TT + [TAG_AUDIO] * 2 * AL + [TAG_VIDEO] * TV + [TAG_PAD] * (s - real)
    vals = layout.timestep_values
    slot = layout.timestep_slot.tolist()
    assert vals[slot[0]] == 0.25 and vals[slot[-1]] == 0.25 and vals[slot[TT + 2 * AL]] == 0.25
    assert [vals[i] for i in slot[TT:TT + 6]] == pytest.approx([1.0] * 3 + [0.6] * 3)
    assert layout.adaln_rows.tolist()[TT] == slot[TT] * 3 + TAG_AUDIO
    assert (layout.positions[real:] == 0).all()


def test_pack_layout_without_video_and_errors():
    pos_t = torch.zeros(4, 3)
    lay = pack_layout(text_len=4, audio_len_per_channel=3, video_rows=0, positions_text=pos_t,
                      positions_audio=torch.zeros(6, 3), positions_video=torch.zeros(0, 3), video_t=0.5, audio_t=0.5)
    assert lay.video_len == 0 and lay.seq_len == 64 and lay.timestep_values == (0.5,)
    model = tiny_model()
    with torch.no_grad():
        v, a = model(torch.zeros(0, 96), torch.randn(6, 32), torch.randn(4, TINY.text_dim), lay, FullAttention(lay))
    assert v.shape == (0, 96) and a.shape == (6, 32) and bool(torch.isfinite(a).all())
    with pytest.raises(ValueError, match="positions_audio"):
        pack_layout(text_len=4, audio_len_per_channel=3, video_rows=0, positions_text=pos_t,
                    positions_audio=torch.zeros(5, 3), positions_video=torch.zeros(0, 3), video_t=0.5, audio_t=0.5)
    with pytest.raises(ValueError, match="video_t"):
        _layout(video_t=1.5)
    with pytest.raises(ValueError, match="audio_timesteps"):
        _layout(audio_timesteps=[0.5] * 5)
    for bad in (1.5, -0.1, float("nan")):  # the row that is out of range is named
        with pytest.raises(ValueError, match=r"audio_timesteps\[4\]=.* must lie in \[0, 1\]"):
            _layout(audio_timesteps=[0.5] * 4 + [bad] + [0.5] * 7)
    # per-row values are rounded to float32 as a single `audio_t` is: the same slot for the same value
    one = _layout(audio_t=0.1)
    rows = _layout(audio_timesteps=[0.1] * 12)
    assert rows.timestep_values == one.timestep_values and torch.equal(rows.timestep_slot, one.timestep_slot)
    with pytest.raises(ValueError, match="exactly one of audio_t"):
        pack_layout(text_len=4, audio_len_per_channel=3, video_rows=0, positions_text=pos_t,
                    positions_audio=torch.zeros(6, 3), positions_video=torch.zeros(0, 3), video_t=0.5, audio_t=0.5,
                    audio_timesteps=[0.5] * 6)
    with pytest.raises(ValueError, match="text_len"):
        pack_layout(text_len=-1, audio_len_per_channel=3, video_rows=0, positions_text=pos_t,
                    positions_audio=torch.zeros(6, 3), positions_video=torch.zeros(0, 3), video_t=0.5, audio_t=0.5)


@torch.no_grad()
def test_forward_rejects_bad_shapes_and_commit_mode_returns_none():
    model = tiny_model()
    layout = _layout()
    video, audio, text = _inputs()
    with pytest.raises(ValueError, match="audio"):
        model(video, audio[:-1], text, layout, FullAttention(layout))
    calls = []

    def attention(layer, q, k, v):
        calls.append((layer, tuple(q.shape)))
        return FullAttention(layout)(layer, q, k, v)

    assert model(video, audio, text, layout, attention, heads=False) is None
    assert calls == [(i, (layout.seq_len, TINY.num_heads, TINY.head_dim)) for i in range(TINY.num_layers)]


@torch.no_grad()
def test_padding_does_not_change_real_rows():
    model = tiny_model(seed=4)
    layout = _layout()
    video, audio, text = _inputs()
    v1, a1 = model(video, audio, text, layout, FullAttention(layout))

    def attention(layer, q, k, v):  # pad rows attending to garbage must not leak into real rows
        out = FullAttention(layout)(layer, q, k, v)
        out[layout.num_real:] = 1e3
        return out

    v2, a2 = model(video, audio, text, layout, attention)
    assert torch.equal(v1, v2) and torch.equal(a1, a2)


@torch.no_grad()
def test_adaln_cache_equivalence_and_report():
    model = tiny_model(seed=3)
    layout = _layout(video_t=0.25, audio_t=0.6)
    video, audio, text = _inputs()
    v_ref, a_ref = model(video, audio, text, layout, FullAttention(layout))
    adaln_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "adaln_proj" in n)
    report = model.cache_adaln([0.9, 0.6, 0.25, 0.6])
    assert report.timesteps == pytest.approx((0.9, 0.6, 0.25)) and len(report.timesteps) == 3
    assert report.bytes_freed == adaln_bytes > 0
    assert report.bytes_table == 4 * 3 * (TINY.num_layers * 18 + 2) * TINY.hidden_size
    assert not any("adaln_proj" in n for n, _ in model.named_parameters())
    v, a = model(video, audio, text, layout, FullAttention(layout))
    assert (v - v_ref).abs().max() <= 1e-6 * max(1.0, v_ref.abs().max().item())
    assert (a - a_ref).abs().max() <= 1e-6 * max(1.0, a_ref.abs().max().item())
    with pytest.raises(AdaLNCacheError, match="not in the AdaLN cache"):
        model(video, audio, text, _layout(audio_t=0.5), FullAttention(layout))
    with pytest.raises(AdaLNCacheError, match="already installed"):
        model.cache_adaln([0.5])

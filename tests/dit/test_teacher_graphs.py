"""Audio-teacher graphs: bucket-padded prompts with masked padding keys give the unpadded result; every step a
session takes is captured at start-up (no miss); on the GPU a replay equals the same eager forward bitwise."""

import pathlib
from dataclasses import replace

import pytest
import torch

from services.common.config import DiTConfig, EncoderConfig, ModelConfig, Profile, load_profile
from services.dit.stream.geometry import TEACHER_TAIL_LATENTS, check_canvas, plan_request
from services.tensors.cuda_graphs import GraphError, PromptBuckets
from services.dit.model.layout import pack_layout
from services.dit.model.network import FullAttention
from services.dit.stream.session import CancelToken
from services.dit.stream.teacher import STEPS, AudioTeacher, request_audio_shapes
from services.dit.stream.teacher import step_layout as teacher_step_layout
from services.dit.stream.timeline import Timeline
from tests.dit.factories import TINY, tiny_model

ARGS = TINY
BUCKETS = PromptBuckets((8, 16))


def request_inputs(k: int, prompt_len: int, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(10 + k)
    plan = plan_request(k)
    text = torch.randn(prompt_len, ARGS.text_dim, generator=gen).to(device, dtype)
    noise = torch.randn(2, plan.num_audio_latents, 32, generator=gen)
    tail = None if k == 0 else torch.randn(2, TEACHER_TAIL_LATENTS, 32, generator=gen)
    return text, plan, noise, tail


def run(teacher, k, prompt_len, device="cpu", dtype=torch.float32):
    text, plan, noise, tail = request_inputs(k, prompt_len, device, dtype)
    timeline = Timeline(check_canvas(96, 64, (64,)), origin=prompt_len)
    return teacher.run(text, plan, timeline, noise, tail, CancelToken())


@pytest.mark.cpu
def test_request_audio_shapes_cover_the_first_and_later_requests():
    shapes = request_audio_shapes()
    assert shapes[0] == (0, plan_request(0).num_audio_latents)
    later = {(TEACHER_TAIL_LATENTS, plan_request(k).num_audio_latents) for k in range(1, 200)}
    assert later == set(shapes[1:])


@pytest.mark.cpu
@pytest.mark.parametrize("k, tail_start", [(0, None), (1, 8 + 207 - 40), (2, 8 + 198 - 40)])
def test_teacher_document_is_the_base_models_audio_only_layout_wherever_the_request_sits(k, tail_start):
    """As the official teacher: text at t = 0..L-1, and a later request's tail and noise placed as if the previous
    request's whole audio (207 latents after request 0, 198 after request 1) followed the text; not on the
    session's timeline, where the text ends against the request's media start."""
    model = tiny_model()
    text, plan, noise, tail = request_inputs(k, 8)
    timeline = Timeline(check_canvas(96, 64, (64,)), origin=13)  # the session's first prompt had 13 tokens
    doc = AudioTeacher(model, None)._document(text, plan, timeline, noise, tail)
    assert doc.pos_text[:, 0].tolist() == list(range(8))
    assert not doc.pos_text[:, 1:].any()
    n_tail = 0 if tail is None else TEACHER_TAIL_LATENTS
    first = 8 if tail_start is None else tail_start
    per_channel = [float(first + i) for i in range(n_tail + plan.num_audio_latents)]
    assert doc.pos_audio[:, 0].tolist() == per_channel * 2
    assert doc.pos_audio[:, 2].unique().numel() == 2  # left / right channel columns, as the student's audio rows


@pytest.mark.cpu
@pytest.mark.parametrize("k, prompt_len", [(0, 5), (1, 8), (2, 11)])
@pytest.mark.slow
def test_padded_teacher_equals_the_unpadded_prompt_and_never_misses(k, prompt_len):
    model = tiny_model()
    ref = run(AudioTeacher(model, None), k, prompt_len)
    teacher = AudioTeacher(model, None)
    teacher.capture_graphs(BUCKETS, request_audio_shapes())
    assert len(teacher.graphs) == len(BUCKETS.sizes) * len(request_audio_shapes()) * STEPS
    got = run(teacher, k, prompt_len)
    assert teacher.graphs.stats.misses == 0
    assert len(got) == 3
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.cpu
def test_padding_rows_are_really_masked():
    # Garbage in the padding rows must not reach the real rows' output.
    model = tiny_model()
    n, size = 5, 8
    text = torch.randn(n, ARGS.text_dim, generator=torch.Generator().manual_seed(1))
    layout = pack_layout(text_len=size, audio_len_per_channel=6, video_rows=0, positions_text=torch.zeros(size, 3),
                         positions_audio=torch.zeros(12, 3), positions_video=torch.zeros(0, 3), video_t=0.5,
                         audio_t=0.5)
    layout = replace(layout, text_valid=torch.arange(size) < n)
    audio = torch.randn(12, 32, generator=torch.Generator().manual_seed(2))
    outs = []
    for fill in (0.0, 100.0):
        padded = torch.cat([text, torch.full((size - n, ARGS.text_dim), fill)])
        outs.append(model(torch.zeros(0, ARGS.video_row_dim), audio, padded, layout, FullAttention(layout))[1])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)


@pytest.mark.cpu
def test_text_valid_is_checked():
    layout = pack_layout(text_len=4, audio_len_per_channel=2, video_rows=0, positions_text=torch.zeros(4, 3),
                         positions_audio=torch.zeros(4, 3), positions_video=torch.zeros(0, 3), video_t=0.5,
                         audio_t=0.5)
    with pytest.raises(ValueError, match="text_valid must be a bool tensor of shape \\(4,\\)"):
        replace(layout, text_valid=torch.ones(3, dtype=torch.bool))


@pytest.mark.cpu
@pytest.mark.slow
def test_a_prompt_longer_than_the_largest_bucket_is_named():
    model = tiny_model()
    teacher = AudioTeacher(model, None)
    teacher.capture_graphs(BUCKETS, request_audio_shapes()[:1])
    with pytest.raises(GraphError, match="prompt of 17 rows exceeds the largest bucket 16"):
        run(teacher, 0, 17)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_teacher_graph_replay_equals_eager_bitwise_on_gpu():
    model = tiny_model("cuda", torch.bfloat16)
    eager = AudioTeacher(model, None)
    eager.buckets = BUCKETS
    graphed = AudioTeacher(model, None)
    graphed.capture_graphs(BUCKETS, request_audio_shapes())
    for k, prompt_len in ((0, 5), (1, 13), (2, 16)):
        got = run(graphed, k, prompt_len, "cuda", torch.bfloat16)
        # the same padded, masked forwards without graphs: a bank with nothing captured runs each step eagerly
        eager.graphs = type(graphed.graphs)("cuda")
        eager.graphs.seal()
        ref = run(eager, k, prompt_len, "cuda", torch.bfloat16)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
        unpadded = run(AudioTeacher(model, None), k, prompt_len, "cuda", torch.bfloat16)
        for a, b in zip(got, unpadded):
            torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)
    assert graphed.graphs.stats.misses == 0 and graphed.graphs.stats.replays == 3 * STEPS


@pytest.mark.cpu
def test_graph_settings_are_validated():
    with pytest.raises(ValueError, match="graphs need CUDA"):
        DiTConfig(devices=("cpu",), cuda_graphs=True)
    with pytest.raises(ValueError, match="teacher_sharded needs dit.cuda_graphs and 2 or 4 dit.devices"):
        DiTConfig(devices=("cuda:0", "cuda:1"), teacher_sharded=True)
    with pytest.raises(ValueError, match="teacher_sharded needs"):
        DiTConfig(devices=("cuda:0",), cuda_graphs=True, teacher_sharded=True)
    with pytest.raises(ValueError, match="strictly increasing"):
        DiTConfig(prompt_buckets=(256, 128))
    with pytest.raises(ValueError, match="largest bucket must hold encoder.max_tokens=512"):
        Profile(name="p", model=ModelConfig(preset="tiny", dir="/models"), encoder=EncoderConfig(max_tokens=512),
                dit=DiTConfig(devices=("cuda:0",), cuda_graphs=True, prompt_buckets=(128, 256)))
    usp2 = load_profile(pathlib.Path(__file__).parents[2] / "configs" / "usp2_fp8.yaml")
    assert usp2.dit.cuda_graphs and usp2.dit.prompt_buckets[-1] >= usp2.encoder.max_tokens


@pytest.mark.cpu
@pytest.mark.parametrize("step", range(STEPS))
def test_teacher_text_rows_take_the_video_clock(step):
    """As the official teacher's denoise loop: text (and pad) rows run at the video timestep of a 10-state shift-12
    grid, the new audio rows at the shift-3 grid's, the clean tail rows at t = 1."""
    from services.dit.stream.schedule import TEACHER_SIGMAS, TEACHER_TEXT_SIGMAS, model_t

    n_tail, num, text_len = TEACHER_TAIL_LATENTS, 198, 8
    layout = teacher_step_layout(step, text_len, n_tail, num, torch.zeros(text_len, 3),
                                 torch.zeros(2 * (n_tail + num), 3), torch.device("cpu"))
    row_t = layout.timesteps[layout.timestep_slot].tolist()
    f32 = lambda x: torch.tensor(x, dtype=torch.float32).item()  # noqa: E731
    assert row_t[:text_len] == [f32(model_t(TEACHER_TEXT_SIGMAS[step]))] * text_len
    audio = row_t[text_len:text_len + 2 * (n_tail + num)]
    assert audio == ([1.0] * n_tail + [f32(model_t(TEACHER_SIGMAS[step]))] * num) * 2
    assert set(row_t[layout.num_real:]) <= {f32(model_t(TEACHER_TEXT_SIGMAS[step]))}

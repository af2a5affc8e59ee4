"""The compiled block regions (the CUDA path) compute what the eager blocks compute, with one graph for every block.

On the CPU the regions run eager; here they are compiled on the CPU too (inductor, the same graphs the GPU gets
apart from the kernels) and swapped into the model, so a recompile per block or a graph break fails the test.
Also here: the FP8 error report still sees every layer once the regions are compiled.
"""
import contextlib
import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters
from torch.fx.experimental import _config as fx_config

from services.common.config import DiTConfig, EncoderConfig, ModelConfig, Profile
from services.dit.model import fused
from services.dit.api import PromptUpdate, SessionConfig
from services.dit.model import network as dit_model
from services.dit.model.fp8 import FP8Linear, fp8_error_report, quantize_linears, relative_error
from services.dit.model.layout import pack_layout
from services.dit.model.lora import LoRAAdapter
from services.dit.model.network import PRESETS, FullAttention
from services.dit.service import build_runtime, compile_block_regions
from tests.dit.factories import TINY, tiny_adapter, tiny_model

ARGS = dataclasses.replace(TINY, num_layers=6)


def _forward(model, tv=12, a=6, tt=5, seed=5):
    gen = torch.Generator().manual_seed(seed)
    layout = pack_layout(text_len=tt, audio_len_per_channel=a, video_rows=tv,
                         positions_text=torch.rand(tt, 3, generator=gen),
                         positions_audio=torch.rand(2 * a, 3, generator=gen),
                         positions_video=torch.rand(tv, 3, generator=gen), video_t=0.3, audio_t=0.6)
    layout = layout.to(model.condition_proj.weight.device)
    with torch.no_grad():
        out = model(torch.randn(tv, 96, generator=gen), torch.randn(2 * a, 32, generator=gen),
                    torch.randn(tt, ARGS.text_dim, generator=gen), layout, FullAttention(layout))
    return torch.cat([o.flatten() for o in out])


REGIONS = ("qkv_projection", "mlp_inputs", "mlp_residual")
PLAIN = {name: getattr(dit_model, name).eager for name in REGIONS}  # the uncompiled functions


@contextlib.contextmanager
def plain_regions():
    """Run the model's block regions as their plain functions, whatever is installed."""
    saved = {name: getattr(dit_model, name) for name in REGIONS}
    for name in REGIONS:
        setattr(dit_model, name, PLAIN[name])
    try:
        yield
    finally:
        for name in REGIONS:
            setattr(dit_model, name, saved[name])


@pytest.fixture
def compiled_regions(monkeypatch):
    """Swap both block regions for their torch.compile'd versions (as on CUDA), on a fresh dynamo cache."""
    torch._dynamo.reset()
    counters.clear()
    saved = fx_config.use_duck_shape, torch._dynamo.config.cache_size_limit
    fused.apply_compiler_settings()
    for name in REGIONS:
        monkeypatch.setattr(dit_model, name, torch.compile(PLAIN[name], dynamic=True, fullgraph=True))
    yield
    fx_config.use_duck_shape, torch._dynamo.config.cache_size_limit = saved
    torch._dynamo.reset()


@pytest.mark.cpu
@pytest.mark.slow
def test_compiled_regions_equal_eager_with_one_graph_per_region_kind(tmp_path, compiled_regions):
    adapter_dir = tiny_adapter(tmp_path / "lora", args=ARGS)
    model = tiny_model(args=ARGS)
    adapter = LoRAAdapter.load(model, adapter_dir)
    quantize_linears(model, ignore=["blocks.0.*", "blocks.5.*"])  # FP8 (reference GEMM) and BF16-kind blocks
    for layer in model.modules():
        if isinstance(layer, FP8Linear):
            layer.backend = "reference"
    with plain_regions():
        student_ref = _forward(model)
        with adapter.suspended():
            teacher_ref = _forward(model)
        other_ref = _forward(model, tv=24, a=9, tt=7, seed=6)

    student = _forward(model)
    graphs_student = counters["stats"]["unique_graphs"]
    with adapter.suspended():
        teacher = _forward(model)
    other = _forward(model, tv=24, a=9, tt=7, seed=6)  # new row counts: dynamic shapes, no new graph
    graphs_all = counters["stats"]["unique_graphs"]

    for got, want in ((student, student_ref), (teacher, teacher_ref), (other, other_ref)):
        assert relative_error(got, want) < 1e-6, relative_error(got, want)
    assert relative_error(student, teacher) > 1e-4  # the LoRA branch is live in the compiled student
    # three regions x (FP8 block, plain block): 6 graphs serve all 6 blocks; the teacher adds LoRA-off variants only
    assert 3 <= graphs_student <= 6, graphs_student
    assert graphs_all <= 12, graphs_all


@pytest.mark.cpu
@pytest.mark.slow
def test_fp8_error_report_sees_every_layer_of_compiled_regions(compiled_regions):
    """Forward hooks added after a region's compile do not fire inside it: the report's forwards run eagerly. The
    regions are compiled and run once before the report, as on CUDA after start-up."""
    model = tiny_model(args=ARGS)
    _forward(model)  # compiles the regions, no hooks yet
    rep = fp8_error_report(model, _forward, ignore=[])
    assert len(rep.layers) == 4 * ARGS.num_layers
    assert all(0 < err < 0.1 for err in rep.layers.values()), rep.layers


@pytest.mark.cpu
@pytest.mark.slow
def test_start_up_compiles_every_region_the_session_uses(compiled_regions):
    """After `compile_block_regions` a session phase (students, teacher, commit; FP8, AdaLN cache) compiles nothing."""
    profile = Profile(name="t", model=ModelConfig(preset="tiny", dir="", random_weights_on_device=True),
                      encoder=EncoderConfig(max_tokens=64),
                      dit=DiTConfig(devices=("cpu",), dtype="float32", canvas_short_edges=(192,), fp8=True,
                                    adaln_cache=True))
    runtime = build_runtime(profile, torch.device("cpu"))
    compile_block_regions(runtime.model, runtime.adapter)
    at_start_up = counters["stats"]["unique_graphs"]
    session = runtime.open_session(SessionConfig(seed=3, width=320, height=192),
                                   PromptUpdate(torch.randn(11, PRESETS["tiny"].text_dim), "p"))
    try:
        session.next_phase()
        session.next_phase()
    finally:
        session.close()
    assert at_start_up >= 6 and counters["stats"]["unique_graphs"] == at_start_up


@pytest.mark.cpu
def test_cpu_runs_the_plain_regions():
    """Off CUDA the regions are the plain functions: nothing is compiled on the CPU service path."""
    torch._dynamo.reset()
    counters.clear()
    _forward(tiny_model(args=ARGS))
    assert counters["stats"]["unique_graphs"] == 0


@pytest.mark.cpu
def test_rope_leaves_the_unrotated_channels_alone():
    x = torch.randn(5, 2, 8)
    cos, sin = torch.ones(5, 6), torch.zeros(5, 6)
    out = fused.apply_rope(x, cos, sin)
    assert torch.equal(out, x)
    out = fused.apply_rope(x, torch.zeros(5, 6), torch.ones(5, 6))  # a quarter turn: (x1, x2) -> (-x2, x1)
    assert torch.equal(out[..., 6:], x[..., 6:])
    assert torch.equal(out[..., :3], -x[..., 3:6]) and torch.equal(out[..., 3:6], x[..., :3])


@pytest.mark.gpu
def test_cuda_forward_compiled_equals_eager_in_bf16():
    """On CUDA the model compiles its regions itself; the result matches the plain regions within BF16 rounding."""
    torch._dynamo.reset()
    model = tiny_model("cuda", torch.bfloat16, args=ARGS)
    compiled = _forward(model)
    with plain_regions():
        eager = _forward(model)
    assert relative_error(compiled, eager) < 2e-2

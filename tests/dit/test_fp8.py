"""FP8 block linears: quantisation math (CPU reference path), layer selection, LoRA compatibility, error report."""

import pytest
import torch
from torch import nn

from services.dit.model.fp8 import (FP8_DTYPE, FP8Linear, Fp8Error, default_ignore, fp8_error_report, quantize_linears,
                              quantize_rows, relative_error)
from services.dit.model.layout import pack_layout
from services.dit.model.lora import LoRAAdapter
from services.dit.model.network import FullAttention
from tests.dit.factories import TINY, tiny_adapter, tiny_model

ARGS = TINY


def forward(model, dtype=torch.float32):
    gen = torch.Generator().manual_seed(5)
    tv, a, tt = 12, 6, 5
    layout = pack_layout(text_len=tt, audio_len_per_channel=a, video_rows=tv,
                         positions_text=torch.rand(tt, 3, generator=gen),
                         positions_audio=torch.rand(2 * a, 3, generator=gen),
                         positions_video=torch.rand(tv, 3, generator=gen), video_t=0.3, audio_t=0.6)
    layout = layout.to(model.condition_proj.weight.device)
    with torch.no_grad():
        return model(torch.randn(tv, 96, generator=gen), torch.randn(2 * a, 32, generator=gen),
                     torch.randn(tt, ARGS.text_dim, generator=gen).to(dtype), layout, FullAttention(layout))


@pytest.mark.cpu
def test_quantize_rows_roundtrip_error_is_e4m3_sized():
    x = torch.randn(64, 256) * torch.logspace(-3, 3, 64)[:, None]  # rows of very different magnitude
    q, s = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and s.shape == (64, 1)
    assert torch.allclose(q.float().abs().amax(-1), torch.full((64,), 448.0))  # each row uses the full range
    back = q.float() * s
    per_row = ((back - x).norm(dim=-1) / x.norm(dim=-1))
    assert per_row.max() < 0.05  # 3 mantissa bits: ~2-4 % relative, independent of the row's magnitude
    assert per_row.min() > 0.0


@pytest.mark.cpu
def test_quantize_rows_zero_row_gives_zeros_not_nan():
    q, s = quantize_rows(torch.zeros(2, 32))
    assert torch.isfinite(s).all() and (q.float() == 0).all()


@pytest.mark.cpu
def test_fp8_linear_matches_dequantized_math_and_shares_parameter():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True)
    w_ref, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    param = lin.weight
    fp8 = FP8Linear.from_linear(lin)
    assert fp8.weight is param and param.dtype == FP8_DTYPE  # same Parameter object, FP8 data
    x = torch.randn(3, 7, 64)
    xq, sx = quantize_rows(x.reshape(-1, 64))
    wq, sw = quantize_rows(w_ref)
    want = ((xq.float() * sx) @ (wq.float() * sw).t() + b).reshape(3, 7, 48)
    got = fp8(x)
    assert got.shape == (3, 7, 48) and got.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert relative_error(got, x @ w_ref.t() + b) < 0.08


@pytest.mark.cpu
def test_scaled_mm_call_convention_on_cpu_kernel():
    """The exact `_scaled_mm` operands FP8Linear builds (row-major x, column-major W^T, [M,1]/[1,N] fp32 scales)
    are accepted by torch's CPU kernel and agree with the dequantising reference path."""
    torch.manual_seed(1)
    fp8 = FP8Linear.from_linear(nn.Linear(64, 48, bias=False).to(torch.bfloat16))
    x = torch.randn(10, 64, dtype=torch.bfloat16)
    xq, sx = quantize_rows(x)
    try:
        out = torch._scaled_mm(xq, fp8.weight.t(), scale_a=sx, scale_b=fp8.weight_scale, out_dtype=torch.bfloat16)
    except NotImplementedError:
        pytest.skip("this torch build has no CPU _scaled_mm")
    fp8.backend = "reference"
    ref = fp8(x)
    assert out.dtype == torch.bfloat16 and out.shape == (10, 48)
    assert torch.allclose(out.float(), ref.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.cpu
def test_fp8_linear_rejects_bad_inputs():
    with pytest.raises(Fp8Error, match="divisible by 16"):
        FP8Linear.from_linear(nn.Linear(20, 32))
    with pytest.raises(Fp8Error, match="nn.Linear"):
        FP8Linear.from_linear(nn.Conv1d(16, 16, 1))
    fp8 = FP8Linear.from_linear(nn.Linear(32, 16))
    with pytest.raises(Fp8Error, match="32 input features"):
        fp8(torch.randn(4, 16))
    fp8.weight = nn.Parameter(torch.randn(16, 32), requires_grad=False)  # a BF16/FP32 weight put back by mistake
    with pytest.raises(Fp8Error, match="after quantisation"):
        fp8(torch.randn(4, 32))


@pytest.mark.cpu
def test_default_ignore_keeps_boundary_blocks():
    assert default_ignore(50) == [f"blocks.{i}.*" for i in (0, 1, 47, 48, 49)]
    assert default_ignore(2) == ["blocks.0.*", "blocks.1.*"]


@pytest.mark.cpu
def test_quantize_selects_block_linears_only():
    model = tiny_model()
    report = quantize_linears(model, ignore=["blocks.1.mlp.*"])
    assert report.quantized == ["blocks.0.attn.qkv_proj", "blocks.0.attn.out_proj", "blocks.0.mlp.fc1",
                                "blocks.0.mlp.fc2", "blocks.1.attn.qkv_proj", "blocks.1.attn.out_proj"]
    assert report.kept == ["blocks.1.mlp.fc1", "blocks.1.mlp.fc2"]
    assert report.bytes_after < report.bytes_before / 3
    assert isinstance(model.blocks[0].mlp.fc1, FP8Linear)
    assert type(model.blocks[1].mlp.fc1) is nn.Linear
    assert type(model.token_refiner.blocks[0].attn.qkv_proj) is nn.Linear  # refiner stays high precision
    with pytest.raises(Fp8Error, match="already FP8"):
        quantize_linears(model, ignore=["blocks.1.mlp.*"])
    with pytest.raises(Fp8Error, match="pattern"):
        quantize_linears(tiny_model(), ignore=[""])
    # default ignore on a 2-block model keeps everything
    assert quantize_linears(tiny_model()).quantized == []


@pytest.mark.cpu
def test_error_report_on_tiny_forward():
    model = tiny_model()
    rep = fp8_error_report(model, forward, ignore=[])
    assert set(rep.layers) == set(rep.quantize.quantized) and len(rep.layers) == 8
    assert all(0.0 < e < 0.08 for e in rep.layers.values())
    assert 0.0 < rep.forward < 0.1
    name, worst = rep.worst_layer()
    assert rep.layers[name] == worst


@pytest.mark.cpu
def test_lora_then_fp8_student_and_teacher(tmp_path):
    adapter_dir = tiny_adapter(tmp_path / "lora")
    ref = tiny_model()
    ref_adapter = LoRAAdapter.load(ref, adapter_dir)
    student_ref = forward(ref)
    with ref_adapter.suspended():
        teacher_ref = forward(ref)

    model = tiny_model()
    adapter = LoRAAdapter.load(model, adapter_dir)
    report = quantize_linears(model, ignore=[])
    assert len(report.quantized) == 8
    layer = model.blocks[0].attn.qkv_proj
    assert isinstance(layer.base_layer, FP8Linear)
    student = forward(model)
    with adapter.suspended():
        teacher = forward(model)
    student_again = forward(model)
    for got, want in ((student, student_ref), (teacher, teacher_ref)):
        assert relative_error(torch.cat([g.flatten() for g in got]), torch.cat([w.flatten() for w in want])) < 0.1
    # LoRA still matters after quantisation, and suspension restores the student bitwise
    assert not torch.equal(student[0], teacher[0])
    assert all(torch.equal(a, b) for a, b in zip(student, student_again))


@pytest.mark.cpu
def test_fp8_before_lora_is_refused_by_peft(tmp_path):
    adapter_dir = tiny_adapter(tmp_path / "lora")
    model = tiny_model()
    quantize_linears(model, ignore=[])
    with pytest.raises(Exception, match="(?i)not supported|FP8Linear"):
        LoRAAdapter.load(model, adapter_dir)


@pytest.mark.gpu
def test_scaled_mm_matches_reference_path():
    from services.dit.model.fp8 import scaled_mm_supported

    dev = torch.device("cuda")
    if not scaled_mm_supported(dev):
        pytest.skip("needs compute capability >= 8.9 for FP8 GEMMs")
    torch.manual_seed(0)
    lin = nn.Linear(512, 768, bias=False).to(dev, torch.bfloat16)
    w_ref = lin.weight.detach().clone()
    fp8 = FP8Linear.from_linear(lin)
    x = torch.randn(300, 512, device=dev, dtype=torch.bfloat16)
    fast = fp8(x)
    fp8.backend = "reference"
    slow = fp8(x)
    assert fast.dtype == torch.bfloat16
    assert relative_error(fast, slow) < 1e-2
    assert relative_error(fast, x @ w_ref.t()) < 0.08


@pytest.mark.gpu
def test_tiny_model_fp8_forward_on_gpu():
    model = tiny_model("cuda", torch.bfloat16)
    rep = fp8_error_report(model, lambda m: forward(m, torch.bfloat16), ignore=[])
    assert len(rep.layers) == 8 and rep.forward < 0.1

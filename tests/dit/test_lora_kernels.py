"""The Triton kernels that finish the QKV projection and fc1 (`services/dit/model/lora_kernels.py`) compute what the
plain-torch reference does: the LoRA up-projection, QK-norm, RoPE, the head-group layout of the send buffer, SwiGLU.

On the CPU they run in Triton's interpreter, in a child process (the interpreter is chosen when Triton is first
imported); on a GPU compiled, in BF16, and inside the DiT's blocks against the reference path.
"""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.dit.model import network as dit_model
from services.dit.model.fp8 import relative_error
from services.dit.model.fused import qk_norm_rope, swiglu
from services.dit.model.layout import pack_layout
from services.dit.model.lora import LoRAAdapter
from services.dit.model.network import FullAttention
from services.dit.model.shard import pack_head_groups
from tests.dit.factories import TINY, tiny_adapter, tiny_model

ROOT = Path(__file__).resolve().parents[2]
CASES = [  # rows, heads, head size, RoPE channels, rank, head groups
    (70, 4, 32, 24, 12, 2),  # a rank not a power of two, rows not a whole number of tiles, two head groups
    (130, 2, 128, 96, 128, 1),  # the full model's head size, RoPE channels and rank
    (5, 4, 32, 24, 12, 4),  # fewer rows than a tile, one head per group
]
SCALES = (None, 0.75, -0.75)
"""No branch (the LoRA suspended), the student's branch, the merged teacher's subtracted branch."""


def _case_tensors(case, device, dtype, seed):
    rows, heads, dim, rope, rank, _ = case
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, spread=1.0):
        return (torch.randn(*shape, generator=gen) * spread).to(device, dtype)

    return dict(base=rand(rows, 3 * heads * dim), down=rand(rows, rank), up=rand(3 * heads * dim, rank, spread=0.1),
                q_weight=rand(dim, spread=0.2) + 1, k_weight=rand(dim, spread=0.2) + 1, cos=rand(rows, rope),
                sin=rand(rows, rope), fc1=rand(rows, 2 * 48), fc1_up=rand(2 * 48, rank, spread=0.1))


def _reference_qkv(t, scale, out):
    x = t["base"].float() if scale is None else t["base"].float() + scale * (t["down"].float() @ t["up"].float().t())
    heads, dim = out.shape[0] * out.shape[3], out.shape[4]
    q, k, v = x.unflatten(-1, (3, heads, dim)).unbind(1)
    q, k = qk_norm_rope(q, k, t["q_weight"].float(), t["k_weight"].float(), 1e-5, t["cos"].float(), t["sin"].float())
    pack_head_groups(q, k, v, out)


def kernel_errors(device: str, dtype: torch.dtype) -> dict[str, float]:
    """Relative error of each kernel against the float32 reference, per case and branch scale."""
    from services.dit.model import lora_kernels
    errors = {}
    for n, case in enumerate(CASES):
        t = _case_tensors(case, device, dtype, seed=n)
        rows, heads, dim, _, _, groups = case
        for scale in SCALES:
            down, up, fc1_up = (None, None, None) if scale is None else (t["down"], t["up"], t["fc1_up"])
            got = torch.full((groups, rows, 3, heads // groups, dim), float("nan"), device=device, dtype=dtype)
            lora_kernels.qkv_heads(t["base"], down, up, scale or 0.0, t["q_weight"], t["k_weight"], 1e-5, t["cos"],
                                   t["sin"], got)
            want = torch.zeros(got.shape)
            _reference_qkv({k: v.cpu() for k, v in t.items()}, scale, want)
            errors[f"qkv_heads case {n} scale {scale}"] = relative_error(got.cpu(), want)
            fc1 = t["fc1"].float() if scale is None else t["fc1"].float() + scale * (
                t["down"].float() @ t["fc1_up"].float().t())
            act = lora_kernels.swiglu(t["fc1"], down, fc1_up, scale or 0.0)
            errors[f"swiglu case {n} scale {scale}"] = relative_error(act.cpu(), swiglu(fc1.cpu()))
    return errors


@pytest.mark.cpu
@pytest.mark.slow
def test_kernels_equal_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    code = ("import sys, torch; sys.path.insert(0, 'tests/dit'); import test_lora_kernels as t\n"
            "for name, err in t.kernel_errors('cpu', torch.float32).items(): print(f'{name}={err!r}')")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = dict(line.split("=") for line in done.stdout.splitlines())
    assert len(errors) == 2 * len(CASES) * len(SCALES), done.stdout
    worst = max(errors, key=lambda k: float(errors[k]))
    assert float(errors[worst]) < 1e-5, (worst, errors[worst])


@pytest.mark.cpu
def test_bad_layouts_are_refused_with_the_tensor_named():
    lora_kernels = pytest.importorskip("services.dit.model.lora_kernels")
    t = _case_tensors(CASES[0], "cpu", torch.float32, seed=0)
    rows, heads, dim, _, _, groups = CASES[0]
    out = torch.empty(groups, rows, 3, heads // groups, dim)
    with pytest.raises(ValueError, match="base .* needs its last dimension contiguous"):
        lora_kernels.qkv_heads(t["base"].t().contiguous().t(), t["down"], t["up"], 1.0, t["q_weight"],
                               t["k_weight"], 1e-5, t["cos"], t["sin"], out)
    with pytest.raises(ValueError, match=r"up \(100, 12\)"):
        lora_kernels.qkv_heads(t["base"], t["down"], t["up"][:100], 1.0, t["q_weight"], t["k_weight"], 1e-5,
                               t["cos"], t["sin"], out)
    with pytest.raises(ValueError, match=r"down \(69, 12\)"):  # one row short: the kernel would read past it
        lora_kernels.qkv_heads(t["base"], t["down"][:69], t["up"], 1.0, t["q_weight"], t["k_weight"], 1e-5,
                               t["cos"], t["sin"], out)
    with pytest.raises(ValueError, match=r"sin \(70, 20\)"):
        lora_kernels.qkv_heads(t["base"], None, None, 1.0, t["q_weight"], t["k_weight"], 1e-5, t["cos"],
                               t["sin"][:, :20], out)
    with pytest.raises(ValueError, match="even width"):
        lora_kernels.swiglu(t["fc1"][:, :95], None, None, 1.0)
    with pytest.raises(ValueError, match="as many down rows"):
        lora_kernels.swiglu(t["fc1"], t["down"][:69], t["fc1_up"], 1.0)


@pytest.mark.gpu
def test_kernels_equal_the_reference_on_the_gpu_in_bf16():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    errors = kernel_errors("cuda", torch.bfloat16)
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] < 1e-2, (worst, errors[worst])


@pytest.mark.gpu
def test_blocks_with_the_kernels_equal_the_reference_blocks(tmp_path, monkeypatch):
    """A tiny BF16 DiT on CUDA, student and teacher: the blocks' Triton path against their plain-torch path."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    args = dataclasses.replace(TINY, num_layers=3)
    model = tiny_model("cuda", torch.bfloat16, args=args)
    # a branch scale of 50 (alpha / rank): the students' output moves ~30% from the teacher's, far above BF16 rounding
    adapter = LoRAAdapter.load(model, tiny_adapter(tmp_path / "lora", args=args, rank=12, alpha=600.0))
    gen = torch.Generator().manual_seed(4)
    tt, a, tv = 9, 6, 40
    layout = pack_layout(text_len=tt, audio_len_per_channel=a, video_rows=tv,
                         positions_text=torch.rand(tt, 3, generator=gen) * 10,
                         positions_audio=torch.rand(2 * a, 3, generator=gen) * 10,
                         positions_video=torch.rand(tv, 3, generator=gen) * 10, video_t=0.3, audio_t=0.6).to("cuda")
    inputs = (torch.randn(tv, args.video_row_dim, generator=gen).cuda(),
              torch.randn(2 * a, args.audio_channels, generator=gen).cuda(),
              torch.randn(tt, args.text_dim, generator=gen).cuda().bfloat16())

    def forward():
        with torch.no_grad():
            return torch.cat([o.flatten() for o in model(*inputs, layout, FullAttention(layout))])

    calls = []
    kernels = dit_model.lora_kernels()
    for name in ("qkv_heads", "swiglu"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    student = forward()
    with adapter.suspended():
        teacher = forward()
    assert calls.count("qkv_heads") == calls.count("swiglu") == 2 * args.num_layers
    monkeypatch.setattr(dit_model, "fused_kernels", lambda *a: False)
    student_ref = forward()
    with adapter.suspended():
        teacher_ref = forward()
    assert relative_error(student, student_ref) < 2e-2 and relative_error(teacher, teacher_ref) < 2e-2
    assert relative_error(student, teacher) > 5 * relative_error(student, student_ref)  # the branch is live

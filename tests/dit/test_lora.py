"""LoRA: native adapter validation, peft installation, teacher/student switching, the LoRA merged into the base."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.dit.api import LoRAError
from services.dit.model.fp8 import quantize_linears, relative_error
from services.dit.stream.geometry import check_canvas, plan_request
from services.dit.model.layout import pack_layout
from services.dit.model.lora import LoRAAdapter, load_adapter, lora_targets
from services.dit.model.network import PRESETS, FullAttention
from services.dit.stream.session import CancelToken
from services.dit.stream.teacher import AudioTeacher
from services.dit.stream.timeline import Timeline
from tests.dit.factories import TINY, tiny_model

pytestmark = pytest.mark.cpu

ARGS = TINY



def forward(model):
    gen = torch.Generator().manual_seed(5)
    tv, a, tt = 12, 6, 5
    layout = pack_layout(text_len=tt, audio_len_per_channel=a, video_rows=tv,
                         positions_text=torch.rand(tt, 3, generator=gen),
                         positions_audio=torch.rand(2 * a, 3, generator=gen),
                         positions_video=torch.rand(tv, 3, generator=gen), video_t=0.3, audio_t=0.6)
    with torch.no_grad():
        return model(torch.randn(tv, 96, generator=gen), torch.randn(2 * a, 32, generator=gen),
                     torch.randn(tt, ARGS.text_dim, generator=gen), layout, FullAttention(layout))


def same(x, y):
    return all(torch.equal(a, b) for a, b in zip(x, y))


def test_full_preset_has_208_targets():
    targets = lora_targets(PRESETS["full"])
    assert len(targets) == 208
    assert targets["blocks.0.attn.qkv_proj"] == (5376, 21504)
    assert targets["token_refiner.blocks.1.mlp.fc2"] == (14336, 5376)
    assert len(lora_targets(ARGS)) == 4 * (ARGS.refiner_layers + ARGS.num_layers)


def test_suspension_nested_and_exceptional_restores_student_bitwise(adapter_dir):
    base = tiny_model()
    base_out = forward(base)
    model = tiny_model()
    weights = {n: (p.data_ptr(), p.clone()) for n, p in model.named_parameters()}
    adapter = LoRAAdapter.load(model, adapter_dir)
    student = forward(model)
    assert not same(student, base_out)  # the adapter changes the output
    with adapter.suspended():
        assert same(forward(model), base_out)
        with adapter.suspended():
            assert same(forward(model), base_out)
        assert same(forward(model), base_out)  # inner exit keeps the outer suspension
    assert same(forward(model), student)
    with pytest.raises(RuntimeError, match="boom"):
        with adapter.suspended():
            with adapter.suspended():
                raise RuntimeError("boom")
    assert adapter.suspended_depth == 0
    assert same(forward(model), student)
    # base weights never mutated: same storage, same values
    for name, p in model.named_parameters():
        key = name.replace(".base_layer", "")
        if key in weights:
            assert p.data_ptr() == weights[key][0] and torch.equal(p, weights[key][1])


def close(x, y, tol):
    return all(torch.allclose(a, b, rtol=tol, atol=tol) for a, b in zip(x, y))


def test_merged_lora_serves_the_student_and_the_teacher(adapter_dir):
    model = tiny_model()
    adapter = LoRAAdapter.load(model, adapter_dir)
    student = forward(model)
    with adapter.suspended():
        teacher = forward(model)
    qkv = model.blocks[0].attn.qkv_proj
    before = qkv.base_layer.weight.clone()
    adapter.merge_into_base()
    assert not torch.allclose(qkv.base_layer.weight, before)  # the LoRA now lives in the base weight
    assert not qkv.merged  # peft's own merge is not used: the factors stay for the teacher's side branch
    merged_student = forward(model)
    assert close(merged_student, student, 1e-5) and not same(merged_student, student)
    with adapter.suspended():
        assert close(forward(model), teacher, 1e-5)  # (W + sBA) x - s B(A x) = W x
        with adapter.suspended():
            assert close(forward(model), teacher, 1e-5)
    assert same(forward(model), merged_student)
    with pytest.raises(LoRAError, match="already merged"):
        adapter.merge_into_base()


def test_merge_refuses_fp8_weights_and_suspension(adapter_dir):
    model = tiny_model()
    adapter = LoRAAdapter.load(model, adapter_dir)
    with adapter.suspended(), pytest.raises(LoRAError, match="inside suspended"):
        adapter.merge_into_base()
    quantize_linears(model, ignore=[])
    with pytest.raises(LoRAError, match="float8_e4m3fn weight .*merge before FP8"):
        adapter.merge_into_base()


def test_merged_fp8_student_and_teacher_match_the_side_branch_within_fp8(adapter_dir):
    outputs = {}
    for merge in (False, True):
        model = tiny_model()
        adapter = LoRAAdapter.load(model, adapter_dir)
        if merge:
            adapter.merge_into_base()
        quantize_linears(model, ignore=[])
        with adapter.suspended():
            teacher = forward(model)
        outputs[merge] = (forward(model), teacher)
    (student, teacher), (merged_student, merged_teacher) = outputs[False], outputs[True]
    for i in range(len(student)):  # video and audio outputs
        lora_effect = relative_error(student[i], teacher[i])
        # the merged path's FP8 rounding differs, but far less than what the LoRA does (a doubled or missing branch
        # in either forward would be off by at least the whole effect)
        assert relative_error(merged_student[i], student[i]) < 0.25 * lora_effect
        assert relative_error(merged_teacher[i], teacher[i]) < 0.25 * lora_effect


@pytest.mark.slow
def test_teacher_output_equals_base_model(adapter_dir):
    canvas = check_canvas(96, 64, (64,))
    text = torch.randn(4, ARGS.text_dim, generator=torch.Generator().manual_seed(2))
    plan = plan_request(1)
    noise = torch.randn(2, plan.num_audio_latents, 32, generator=torch.Generator().manual_seed(3))
    tail = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(4))
    tl = Timeline(canvas, origin=4)
    base = tiny_model()
    ref = AudioTeacher(base, None).run(text, plan, tl, noise, tail, CancelToken())
    model = tiny_model()
    adapter = LoRAAdapter.load(model, adapter_dir)
    got = AudioTeacher(model, adapter).run(text, plan, tl, noise, tail, CancelToken())
    assert len(got) == 3 and got[0].shape == (2, plan.num_audio_latents, 32)
    assert same(got, ref)
    assert adapter.suspended_depth == 0  # the student is back after the teacher
    adapter.merge_into_base()
    merged = AudioTeacher(model, adapter).run(text, plan, tl, noise, tail, CancelToken())
    assert close(merged, ref, 1e-4)


def _corrupt(src, dst, edit=None, config=None):
    tensors = load_file(str(src / "adapter_model.safetensors"))
    if edit:
        edit(tensors)
    dst.mkdir()
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if config is not None:
        cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("case, edit, config, message", [
    ("missing", lambda t: t.pop("blocks.1.mlp.fc2.lora_b"), None, r"missing tensors \['blocks.1.mlp.fc2.lora_b'\]"),
    ("extra", lambda t: t.__setitem__("blocks.9.attn.qkv_proj.lora_a", torch.zeros(12, 96)), None,
     r"unexpected tensors \['blocks.9.attn.qkv_proj.lora_a'\]"),
    ("rank", None, {"rank": 8}, r"token_refiner.blocks.0.attn.qkv_proj.lora_a .*rank 12 does not match .*rank 8"),
    ("shape", lambda t: t.__setitem__("blocks.0.mlp.fc1.lora_b", torch.zeros(100, 12)), None,
     r"blocks.0.mlp.fc1.lora_b has shape \(100, 12\), expected \(384, 12\)"),
    ("nan", lambda t: t["blocks.1.attn.out_proj.lora_a"].__setitem__((0, 0), float("nan")), None,
     r"blocks.1.attn.out_proj.lora_a contains NaN or Inf"),
    ("inf", lambda t: t["token_refiner.blocks.1.mlp.fc1.lora_b"].__setitem__((3, 1), float("inf")), None,
     r"token_refiner.blocks.1.mlp.fc1.lora_b contains NaN or Inf"),
])
def test_malformed_adapters_are_rejected_by_name(adapter_dir, tmp_path, case, edit, config, message):
    bad = _corrupt(adapter_dir, tmp_path / case, edit, config)
    with pytest.raises(LoRAError, match=message):
        load_adapter(bad, ARGS)


def test_missing_files_and_bad_config(adapter_dir, tmp_path):
    with pytest.raises(LoRAError, match="does not exist"):
        load_adapter(tmp_path / "nope", ARGS)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LoRAError, match="no adapter config"):
        load_adapter(empty, ARGS)
    bad = _corrupt(adapter_dir, tmp_path / "alpha", config={"alpha": -1})
    with pytest.raises(LoRAError, match="'alpha' must be a positive number"):
        load_adapter(bad, ARGS)
    peft_style = tmp_path / "peft_style"
    peft_style.mkdir()
    (peft_style / "adapter_config.json").write_text(json.dumps({"r": 12, "lora_alpha": 24}))
    (peft_style / "adapter_model.safetensors").write_bytes((adapter_dir / "adapter_model.safetensors").read_bytes())
    spec = load_adapter(peft_style, ARGS)
    assert (spec.rank, spec.alpha, spec.scale) == (12, 24.0, 2.0)


def test_scale_alpha_over_rank_applied_once(adapter_dir, tmp_path):
    src = _corrupt(adapter_dir, tmp_path / "alpha24", config={"alpha": 24})  # rank 12: scale 2
    model = tiny_model()
    adapter = LoRAAdapter.load(model, src)
    layer = model.blocks[1].mlp.fc1
    a, b = adapter.spec.factors["blocks.1.mlp.fc1"]
    x = torch.randn(3, ARGS.hidden_size)
    with torch.no_grad():
        expected = layer.base_layer(x) + 2.0 * (x @ a.T @ b.T)
        assert torch.allclose(layer(x), expected, atol=1e-6)

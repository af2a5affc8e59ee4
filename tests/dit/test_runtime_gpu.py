"""Streaming runtime on CUDA (tiny preset, BF16 model and LoRA factors): shapes, dtypes and determinism."""

import pytest
import torch

from services.dit.api import PromptUpdate, RuntimeConfig, SessionConfig
from services.dit.model.lora import LoRAAdapter
from services.dit.stream.runtime import DiTRuntime
from tests.dit.factories import TINY, tiny_adapter, tiny_model

pytestmark = pytest.mark.gpu

ARGS = TINY


def run(adapter_dir, reuse_text_kv: bool = True, text_buckets: tuple[int, ...] = ()):
    model = tiny_model("cuda", torch.bfloat16)
    adapter = LoRAAdapter.load(model, adapter_dir)
    config = RuntimeConfig.for_preset("tiny", max_text_tokens=16, reuse_text_kv=reuse_text_kv,
                                      text_buckets=text_buckets)
    rt = DiTRuntime(model, config, adapter)
    session = rt.open_session(SessionConfig(seed=4, width=256, height=192),
                              PromptUpdate(torch.randn(6, ARGS.text_dim, generator=torch.Generator().manual_seed(1)),
                                           "e0"))
    assert session.kv.k[0].dtype == torch.bfloat16 and session.kv.k[0].is_cuda
    factor = model.blocks[0].attn.qkv_proj.lora_A["taomate"].weight
    assert factor.dtype == torch.bfloat16 and factor.is_cuda
    outs = [session.next_phase() for _ in range(5)]
    session.close()
    return outs


def test_cuda_bf16_session_is_deterministic(tmp_path):
    adapter_dir = tiny_adapter(tmp_path)
    a, b = run(adapter_dir), run(adapter_dir)
    for x, y in zip(a, b):
        assert x.video.shape[1:] == (24, 12, 16) and x.video.dtype == torch.float32
        assert torch.isfinite(x.video).all() and torch.isfinite(x.audio).all()
        assert torch.equal(x.video, y.video) and torch.equal(x.audio, y.audio)


def test_cuda_reused_text_kv_within_bf16_of_running_the_text_rows(tmp_path):
    # the compiled block regions run with and without text rows; the text K/V come from a forward of other row count
    adapter_dir = tiny_adapter(tmp_path)
    reused, recomputed = run(adapter_dir), run(adapter_dir, reuse_text_kv=False)
    for x, y in zip(reused, recomputed):
        assert torch.equal(x.audio, y.audio)  # the teacher's
        assert (x.video - y.video).norm() <= 2e-2 * y.video.norm()


def test_cuda_text_padded_to_a_bucket_within_bf16_of_the_exact_rows(tmp_path):
    # the usp2 profile's student and commit forwards run the text padded (RuntimeConfig.text_buckets)
    adapter_dir = tiny_adapter(tmp_path)
    padded, exact = run(adapter_dir, text_buckets=(64,)), run(adapter_dir)
    for x, y in zip(padded, exact):
        assert torch.equal(x.audio, y.audio)  # the teacher's
        assert (x.video - y.video).norm() <= 2e-2 * y.video.norm()

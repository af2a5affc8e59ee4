"""`dit.attention`: each DiT rank process sets its attention kernels once: the SDPA kernel order (torch keeps it
process-global) and, with `fa4`, FlashAttention 4 for the unmasked CUDA attention."""
import json
import subprocess
import sys
import textwrap

import pytest

ORDER = "from torch.nn.attention import SDPBackend; import torch; " \
        "order = lambda: [SDPBackend(i).name for i in torch._C._get_sdp_priority_order()][:4]; "


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


@pytest.mark.cpu
@pytest.mark.slow
def test_cudnn_goes_first_for_the_whole_process_and_default_changes_nothing():
    out = run(ORDER + """
import json, threading
from services.dit.model.attention_kernels import prefer_attention_kernels
before = order()
prefer_attention_kernels("default")
assert order() == before, order()
prefer_attention_kernels("cudnn")
seen = []
t = threading.Thread(target=lambda: seen.append(order())); t.start(); t.join()
print(json.dumps([before, order(), seen[0]]))
""")
    before, after, thread = json.loads(out)
    assert before[0] == "FLASH_ATTENTION"
    assert after == ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
    assert thread == after  # the gRPC worker threads see it too


@pytest.mark.cpu
def test_unknown_order_is_named():
    from services.dit.model.attention_kernels import prefer_attention_kernels

    with pytest.raises(ValueError, match="unknown attention kernels 'flash3'"):
        prefer_attention_kernels("flash3")


@pytest.mark.gpu
def test_cudnn_order_runs_cudnn_and_equals_flash_within_bf16():
    # (torch 2.11 on an H200 already tries cuDNN first by default: the flash forward is forced here)
    pytest.importorskip("torch").cuda.is_available() or pytest.skip("needs a CUDA GPU")
    out = run("""
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
from services.dit.model.layout import pack_layout
from services.dit.model.attention_kernels import prefer_attention_kernels
from services.dit.model.network import PRESETS, FullAttention, build_random

args = PRESETS["tiny"]
model = build_random(args, "cuda", torch.bfloat16, seed=0)
gen = torch.Generator().manual_seed(3)
tt, a, tv = 24, 40, 600
layout = pack_layout(text_len=tt, audio_len_per_channel=a, video_rows=tv, positions_text=torch.rand(tt, 3),
                     positions_audio=torch.rand(2 * a, 3), positions_video=torch.rand(tv, 3), video_t=0.4,
                     audio_t=0.7).to("cuda")
inputs = (torch.randn(tv, args.video_row_dim, generator=gen).cuda(),
          torch.randn(2 * a, args.audio_channels, generator=gen).cuda(),
          torch.randn(tt, args.text_dim, generator=gen).cuda().bfloat16())

def forward():
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = model(*inputs, layout, FullAttention(layout))
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    return torch.cat([o.float().flatten() for o in out]), any("flash_fwd" in n for n in names), \\
        any("cudnn" in n.lower() for n in names)

with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
    flash, flash_ran, _ = forward()
prefer_attention_kernels("cudnn")
cudnn, flash_again, cudnn_ran = forward()
err = ((cudnn - flash).norm() / flash.norm()).item()
print(flash_ran, flash_again, cudnn_ran, err)
""")
    flash_ran, flash_again, cudnn_ran, err = out.split()
    assert flash_ran == "True" and flash_again == "False" and cudnn_ran == "True", out
    assert float(err) < 2e-2, out


@pytest.mark.gpu
def test_cudnn_attention_reads_q_k_v_in_place_in_the_ulysses_receive_buffer():
    """Under Ulysses the patterns get q, k, v as the three planes of the all-to-all's receive buffer `[S, 3, H, D]`
    (the streaming pattern: q from there, k and v from the KV cache). cuDNN must take them as they are: with no other
    kernel allowed a refusal would raise, and the result equals the one from contiguous copies."""
    torch = pytest.importorskip("torch")
    torch.cuda.is_available() or pytest.skip("needs a CUDA GPU")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from services.dit.model.attention_kernels import sdpa_rows

    gen = torch.Generator(device="cuda").manual_seed(0)
    recv = torch.randn(2048, 3, 28, 96, device="cuda", dtype=torch.bfloat16, generator=gen)  # full preset's USP2 heads
    cache_k, cache_v = (torch.randn(3000, 28, 96, device="cuda", dtype=torch.bfloat16, generator=gen)
                        for _ in range(2))
    q, k, v = recv.unbind(1)
    with torch.no_grad(), sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        cases = [(sdpa_rows(q, k, v), sdpa_rows(q.contiguous(), k.contiguous(), v.contiguous())),
                 (sdpa_rows(q[100:1900], cache_k, cache_v), sdpa_rows(q[100:1900].contiguous(), cache_k, cache_v))]
    for in_place, copied in cases:
        err = ((in_place.float() - copied.float()).norm() / copied.float().norm()).item()
        assert err < 1e-3, err


def _fa4_importable() -> bool:
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        return False
    return True


def _needs_cuda_and_fa4():
    """torch, or a skip without a CUDA GPU or FlashAttention 4."""
    torch = pytest.importorskip("torch")
    torch.cuda.is_available() or pytest.skip("needs a CUDA GPU")
    _fa4_importable() or pytest.skip("needs FlashAttention 4 (flash-attn-4)")
    return torch


@pytest.mark.cpu
@pytest.mark.slow
def test_fa4_without_its_package_is_refused_naming_the_package_and_the_way_out():
    if _fa4_importable():
        pytest.skip("FlashAttention 4 is installed here")
    out = run(ORDER + """
from services.dit.model.attention_kernels import prefer_attention_kernels
before = order()
try:
    prefer_attention_kernels("fa4")
except RuntimeError as e:
    print(order() == before)
    print(e)
""")
    unchanged, message = out.split("\n", 1)
    assert unchanged == "True"  # nothing half-set: the SDPA order is as it was
    assert "dit.attention: fa4 needs FlashAttention 4" in message and "flash-attn-4" in message
    assert "set dit.attention: cudnn" in message


FA4_CASES = """
import torch
from services.dit.model.attention_kernels import prefer_attention_kernels, sdpa_rows, _FLASH_ATTENTION_4

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()

gen = torch.Generator(device="cuda").manual_seed(0)
recv = torch.randn(1500, 3, 28, 128, device="cuda", dtype=torch.bfloat16, generator=gen)  # a USP2 rank's heads
cache_k, cache_v = (torch.randn(5000, 28, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
q, k, v = recv.unbind(1)
valid = torch.ones(1500, dtype=torch.bool, device="cuda"); valid[1400:] = False
cases = {"media over the cache": (q[100:], cache_k, cache_v, None),
         "text-only, in place": (q[:100], k[:100], v[:100], None), "masked keys": (q, k, v, valid)}
reference = {name: sdpa_rows(*(t.float() for t in c[:3]), c[3]) for name, c in cases.items()}  # float32, SDPA
cudnn = {name: sdpa_rows(*c) for name, c in cases.items()}
prefer_attention_kernels("fa4")
calls = []
inner = _FLASH_ATTENTION_4[0]
_FLASH_ATTENTION_4[0] = lambda *a, **kw: calls.append(a[0].shape[1]) or inner(*a, **kw)
"""


@pytest.mark.gpu
def test_fa4_takes_the_unmasked_calls_in_place_and_equals_cudnn_within_bf16():
    """The streaming pattern's two unmasked calls (media rows over the KV cache, q a plane of the Ulysses receive
    buffer; text rows over text keys, all three planes of it) go to FlashAttention 4 as they lie, and land as close
    to a float32 reference as cuDNN does; a masked call stays with SDPA."""
    _needs_cuda_and_fa4()
    out = run(FA4_CASES + """
import json
rows = {}
for name, c in cases.items():
    calls.clear()
    got = sdpa_rows(*c)
    rows[name] = [list(calls), rel(got, reference[name]), rel(cudnn[name], reference[name]), list(got.shape)]
print(json.dumps(rows))
""")
    import json
    rows = json.loads(out.splitlines()[-1])
    assert rows["media over the cache"][0] == [1400] and rows["text-only, in place"][0] == [100]
    assert rows["masked keys"][0] == []  # FlashAttention 4 takes no key mask here: SDPA serves it
    for name, (_, fa4_err, cudnn_err, shape) in rows.items():
        assert shape == [1400 if name == "media over the cache" else (100 if "text" in name else 1500), 28, 128]
        assert fa4_err < 1.5 * cudnn_err + 1e-4 and fa4_err < 1e-2, (name, fa4_err, cudnn_err)


@pytest.mark.gpu
def test_fa4_replays_in_a_cuda_graph_bitwise_like_eager():
    """The audio teacher's steps are CUDA graphs, and its pad rows' attention is unmasked: FlashAttention 4 must
    launch on the capturing stream, and a replay equal the eager call bit for bit."""
    _needs_cuda_and_fa4()
    out = run(FA4_CASES + """
qq, kk, vv = (t.clone() for t in (q[100:], cache_k, cache_v))
eager = sdpa_rows(qq, kk, vv).clone()
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    sdpa_rows(qq, kk, vv)  # warm-up on the capturing stream
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    captured = sdpa_rows(qq, kk, vv)
qq.copy_(torch.randn_like(qq)); graph.replay(); torch.cuda.synchronize()
moved = rel(captured, eager) > 1e-2  # new inputs, new output: the graph reads the buffers
fresh = sdpa_rows(qq, kk, vv)
print(bool(torch.equal(captured, fresh)), moved, len(calls) >= 3)
""")
    bitwise, moved, went_through_fa4 = out.split()[-3:]
    assert (bitwise, moved, went_through_fa4) == ("True", "True", "True"), out


SESSION = """
import sys, torch
from services.dit.api import PromptUpdate, RuntimeConfig, SessionConfig
from services.dit.model.lora import LoRAAdapter
from services.dit.model import attention_kernels, network as dit_model
from services.dit.stream.runtime import DiTRuntime

kernels, adapter_dir, out = sys.argv[1:4]
attention_kernels.prefer_attention_kernels(kernels)
calls = []
if kernels == "fa4":
    inner = attention_kernels._FLASH_ATTENTION_4[0]
    attention_kernels._FLASH_ATTENTION_4[0] = lambda *a, **kw: calls.append(1) or inner(*a, **kw)
args = dit_model.PRESETS["tiny"]
model = dit_model.build_random(args, "cuda", torch.bfloat16, seed=0)
rt = DiTRuntime(model, RuntimeConfig.for_preset("tiny", max_text_tokens=16), LoRAAdapter.load(model, adapter_dir))
session = rt.open_session(SessionConfig(seed=4, width=256, height=192),
                          PromptUpdate(torch.randn(6, args.text_dim, generator=torch.Generator().manual_seed(1)), "e0"))
phases = [session.next_phase() for _ in range(5)]
session.close()
torch.save({"video": [p.video.cpu() for p in phases], "audio": [p.audio.cpu() for p in phases]}, out)
print(len(calls))
"""


@pytest.mark.gpu
def test_a_streaming_session_with_fa4_is_within_bf16_of_cudnn(tmp_path):
    """The whole runtime (teacher, students, commits over the growing KV cache) with `fa4` against `cudnn`: the
    same latents within BF16 rounding, and FlashAttention 4 ran in it."""
    torch = _needs_cuda_and_fa4()
    from tests.dit.factories import tiny_adapter

    adapter_dir = tiny_adapter(tmp_path / "adapter")
    results = {}
    for kernels in ("cudnn", "fa4"):
        done = subprocess.run([sys.executable, "-c", SESSION, kernels, str(adapter_dir), str(tmp_path / kernels)],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results[kernels] = (int(done.stdout.split()[-1]), torch.load(tmp_path / kernels))
    assert results["cudnn"][0] == 0 and results["fa4"][0] > 0
    cudnn, fa4 = results["cudnn"][1], results["fa4"][1]
    for key in ("video", "audio"):
        for x, y in zip(fa4[key], cudnn[key]):
            assert torch.isfinite(x).all() and x.shape == y.shape
            assert (x - y).norm() <= 2e-2 * y.norm(), (key, ((x - y).norm() / y.norm()).item())

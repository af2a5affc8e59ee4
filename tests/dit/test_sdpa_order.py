"""`dit.attention`: each DiT rank process sets its SDPA kernel order once (torch keeps it process-global)."""
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
def test_cudnn_goes_first_for_the_whole_process_and_default_changes_nothing():
    out = run(ORDER + """
import json, threading
from services.dit.model import prefer_sdpa_kernels
before = order()
prefer_sdpa_kernels("default")
assert order() == before, order()
prefer_sdpa_kernels("cudnn")
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
    from services.dit.model import prefer_sdpa_kernels

    with pytest.raises(ValueError, match="unknown SDPA kernel order 'flash3'"):
        prefer_sdpa_kernels("flash3")


@pytest.mark.gpu
def test_cudnn_order_runs_cudnn_and_equals_flash_within_bf16():
    # (torch 2.11 on an H200 already tries cuDNN first by default: the flash forward is forced here)
    pytest.importorskip("torch").cuda.is_available() or pytest.skip("needs a CUDA GPU")
    out = run("""
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
from services.dit.layout import pack_layout
from services.dit.model import PRESETS, FullAttention, build_random, prefer_sdpa_kernels

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
prefer_sdpa_kernels("cudnn")
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

    from services.dit.model import sdpa_rows

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

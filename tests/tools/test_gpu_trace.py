"""What the bench's `--trace-request` prints: how busy each GPU was (the union of its kernels' intervals, however
many streams overlap), kernel seconds by kind and the kernels with the most GPU time."""

import pytest
import torch

from tools.gpu_trace import Kernel, KernelTrace, busy_us, category, summary, top_kernels


@pytest.mark.cpu
def test_busy_time_is_the_union_of_overlapping_kernels():
    ks = [Kernel("a", 0, 0, 10), Kernel("b", 0, 5, 12), Kernel("c", 0, 20, 25), Kernel("d", 0, 21, 22),
          Kernel("e", 0, 25, 30)]
    assert busy_us(ks) == 12 + 10  # [0, 12] and [20, 30]
    assert busy_us([]) == 0


@pytest.mark.cpu
def test_summary_splits_devices_and_kinds():
    ks = [Kernel("ncclDevKernel_SendRecv", 0, 0, 400_000), Kernel("cudnn_generated_fort_native_sdpa", 0, 0, 300_000),
          Kernel("nvjet_tst_128x256_h_bz", 0, 500_000, 700_000), Kernel("triton_poi_fused_add_0", 1, 0, 100_000)]
    lines = summary(ks, wall_s=1.0, top=0)
    assert lines[0].startswith("cuda:0: busy 0.600 of 1.000 s (60%)")
    assert "nccl 0.400, attention 0.300, gemm 0.200 (3 kernels)" in lines[0]
    assert lines[1].startswith("cuda:1: busy 0.100 of 1.000 s (10%)") and "other 0.100" in lines[1]
    assert [category(k.name) for k in ks] == ["nccl", "attention", "gemm", "other"]


@pytest.mark.cpu
def test_summary_lists_the_kernels_with_the_most_gpu_time_per_device():
    ks = [Kernel("nvjet_a", 0, 0, 100_000), Kernel("triton_b", 0, 0, 150_000), Kernel("nvjet_a", 0, 200_000, 300_000),
          Kernel("ncclDevKernel_c", 0, 0, 10_000), Kernel("triton_b", 1, 0, 50_000)]
    assert top_kernels(ks[:4], 2) == [("nvjet_a", "gemm", 0.2, 2), ("triton_b", "other", 0.15, 1)]
    lines = summary(ks, wall_s=1.0, top=2)
    assert lines[1].split() == ["0.200", "s", "2x", "gemm", "nvjet_a"]
    assert lines[2].split() == ["0.150", "s", "1x", "other", "triton_b"]
    assert lines[3].startswith("cuda:1:") and lines[4].split()[-1] == "triton_b" and len(lines) == 5


@pytest.mark.gpu
def test_a_trace_records_this_process_kernels():
    x = torch.randn(2048, 2048, device="cuda")
    with KernelTrace() as trace:
        for _ in range(3):
            x = x @ x / 2048
    assert trace.kernels and not trace.running
    assert 0 < busy_us(trace.kernels) / 1e6 <= trace.wall_s
    assert any(category(k.name) == "gemm" for k in trace.kernels)

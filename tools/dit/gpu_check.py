"""One-shot GPU check of FP8 linears and the CUDA IPC pool (`python -m tools.dit.gpu_check`).

Runs on one CUDA machine (H200 expected, < ~3 min): FP8 vs BF16 error on the tiny model and on real-size linears,
FP8 vs BF16 GEMM speed at the real shapes, and 1,000 IPC chunks between two processes with flat
`torch.cuda.memory_allocated`. Prints a summary table last and exits non-zero when a correctness check fails.
Knows nothing about services, sessions or checkpoints.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import sys
import time

import torch
import torch.nn.functional as F

from services.tensors.cuda_ipc import IpcConsumer, IpcProducer
from services.tensors.stage_transport import send_tensor
from services.dit.model.fp8 import FP8Linear, fp8_error_report, quantize_rows, relative_error, scaled_mm_supported
from services.dit.model.layout import pack_layout
from services.dit.model.network import PRESETS, FullAttention, build_random
from vitascope.common.v1 import tensor_pb2 as pb

log = logging.getLogger(__name__)

ROWS = 4608
REAL_SHAPES = (("qkv_proj", 5376, 21504), ("out_proj", 7168, 5376), ("fc1", 5376, 28672), ("fc2", 14336, 5376))
"""(name, K in, N out) of the full-preset block linears."""


# ---------------------------------------------------------------------------------------------------- FP8


def tiny_fp8_error(dev: torch.device) -> tuple[float, float]:
    """(worst layer, full forward) relative error of FP8 vs BF16 on the tiny model, all blocks quantised."""
    args = PRESETS["tiny"]
    model = build_random(args, dev, torch.bfloat16, seed=0)
    gen = torch.Generator().manual_seed(5)
    tv, a, tt = 64, 24, 16
    layout = pack_layout(text_len=tt, audio_len_per_channel=a, video_rows=tv,
                         positions_text=torch.rand(tt, 3, generator=gen) * 8,
                         positions_audio=torch.rand(2 * a, 3, generator=gen) * 8,
                         positions_video=torch.rand(tv, 3, generator=gen) * 8, video_t=0.3, audio_t=0.6).to(dev)
    video, audio = torch.randn(tv, 96, generator=gen).to(dev), torch.randn(2 * a, 32, generator=gen).to(dev)
    text = torch.randn(tt, args.text_dim, generator=gen).to(dev, torch.bfloat16)
    rep = fp8_error_report(model, lambda m: m(video, audio, text, layout, FullAttention(layout)), ignore=[])
    return rep.worst_layer()[1], rep.forward


def _time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def real_linears(dev: torch.device, rows: int) -> list[dict]:
    """Error and speed of FP8 vs BF16 at the real block-linear shapes with `rows` tokens."""
    results = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, k, n in REAL_SHAPES:
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.normal_(0.0, 0.02, generator=gen)
        w_ref = lin.weight.detach().clone()
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=gen)
        fp8 = FP8Linear.from_linear(lin)
        with torch.no_grad():
            ref = F.linear(x, w_ref)
            err = relative_error(fp8(x), ref)
            xq, sx = quantize_rows(x)
            flops = 2.0 * rows * k * n
            t_bf16 = _time_ms(lambda: F.linear(x, w_ref))
            t_gemm = _time_ms(lambda: torch._scaled_mm(xq, fp8.weight.t(), scale_a=sx, scale_b=fp8.weight_scale,
                                                       out_dtype=torch.bfloat16))
            t_layer = _time_ms(lambda: fp8(x))
        results.append({"name": name, "k": k, "n": n, "rel_err": err, "bf16_ms": t_bf16, "fp8_gemm_ms": t_gemm,
                        "fp8_layer_ms": t_layer, "bf16_tflops": flops / t_bf16 / 1e9,
                        "fp8_tflops": flops / t_gemm / 1e9})
        del lin, fp8, w_ref, x, xq, ref
        torch.cuda.empty_cache()
    return results


# ---------------------------------------------------------------------------------------------------- IPC


def make_chunk(i: int, device: torch.device) -> torch.Tensor:
    """Deterministic bf16 chunk number `i` (exact small integers), varying shape."""
    rows = 64 + 32 * (i % 5)
    return ((torch.arange(rows * 512, device=device) % 251) + (i % 7)).to(torch.bfloat16).reshape(rows, 512)


def _consumer(conn, chunks: int) -> None:
    torch.cuda.init()
    consumer = IpcConsumer()
    mismatches, baseline = 0, None
    for i in range(chunks):
        part = pb.TensorPart.FromString(conn.recv_bytes())
        tensor, release = consumer.open(part)
        if not torch.equal(tensor, make_chunk(i, tensor.device)):
            mismatches += 1
        del tensor
        conn.send_bytes(release.SerializeToString())
        if i == 9:
            baseline = torch.cuda.memory_allocated()
    conn.send((mismatches, torch.cuda.memory_allocated() - baseline))


def ipc_flatness_loop(chunks: int = 1000, device: int = 0) -> dict:
    """Export/open/release `chunks` tensors between this process and a spawned consumer; memory growth per side."""
    dev = torch.device("cuda", device)
    torch.cuda.set_device(dev)
    producer = IpcProducer(dev, 8 << 20, num_slots=4)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(child, chunks), daemon=True)
    proc.start()
    baseline = None
    t0 = time.perf_counter()
    try:
        for i in range(chunks):
            (part,) = send_tensor(make_chunk(i, dev), producer, "gpu_check")
            if part.WhichOneof("where") != "cuda":
                raise RuntimeError(f"chunk {i} fell back to host bytes")
            parent.send_bytes(part.SerializeToString())
            if not parent.poll(60):
                raise RuntimeError(f"consumer did not release chunk {i} within 60 s")
            producer.release(pb.Release.FromString(parent.recv_bytes()))
            if i == 9:
                baseline = torch.cuda.memory_allocated(dev)
        if not parent.poll(60):
            raise RuntimeError("consumer did not report")
        mismatches, consumer_growth = parent.recv()
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
    return {"chunks": chunks, "mismatches": mismatches, "producer_growth_bytes": torch.cuda.memory_allocated(dev) -
            baseline, "consumer_growth_bytes": consumer_growth, "leased_after": producer.leased,
            "ms_per_chunk": (time.perf_counter() - t0) * 1e3 / chunks}


# ---------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=ROWS, help="tokens (M) of the real-shape GEMMs")
    parser.add_argument("--chunks", type=int, default=1000, help="IPC chunks between the two processes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        log.error("gpu_check needs a CUDA device")
        return 2
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    t0 = time.perf_counter()
    failures: list[str] = []
    rows: list[tuple[str, str, str]] = []

    if scaled_mm_supported(dev):
        worst, fwd = tiny_fp8_error(dev)
        rows.append(("fp8 tiny: worst layer / forward rel err", f"{worst:.4f} / {fwd:.4f}", "< 0.08 / < 0.1"))
        if not (worst < 0.08 and fwd < 0.1):
            failures.append("fp8 tiny error")
        for r in real_linears(dev, args.rows):
            rows.append((f"fp8 {r['name']} M={args.rows} K={r['k']} N={r['n']}",
                         f"err {r['rel_err']:.4f}; bf16 {r['bf16_ms']:.3f} ms ({r['bf16_tflops']:.0f} TF/s), "
                         f"fp8 gemm {r['fp8_gemm_ms']:.3f} ms ({r['fp8_tflops']:.0f} TF/s), "
                         f"fp8 layer {r['fp8_layer_ms']:.3f} ms, x{r['bf16_ms'] / r['fp8_gemm_ms']:.2f}",
                         "err < 0.08"))
            if not r["rel_err"] < 0.08:
                failures.append(f"fp8 {r['name']} error")
    else:
        rows.append(("fp8", "skipped: compute capability < 8.9", ""))

    ipc = ipc_flatness_loop(args.chunks)
    rows.append((f"ipc {ipc['chunks']} chunks: mismatches / growth prod / cons",
                 f"{ipc['mismatches']} / {ipc['producer_growth_bytes']} B / {ipc['consumer_growth_bytes']} B, "
                 f"{ipc['ms_per_chunk']:.2f} ms/chunk, leased after {ipc['leased_after']}", "0 / 0 / 0"))
    if ipc["mismatches"] or ipc["producer_growth_bytes"] or ipc["consumer_growth_bytes"] or ipc["leased_after"]:
        failures.append("ipc")

    width = max(len(r[0]) for r in rows)
    lines = [f"gpu_check on {torch.cuda.get_device_name(dev)} (torch {torch.__version__}), "
             f"{time.perf_counter() - t0:.1f} s"]
    lines += [f"{name:<{width}}  {value}   [want {want}]" if want else f"{name:<{width}}  {value}"
              for name, value, want in rows]
    lines.append("FAILED: " + ", ".join(failures) if failures else "ALL CHECKS PASSED")
    print("\n".join(lines), flush=True)  # the report of this command-line tool
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

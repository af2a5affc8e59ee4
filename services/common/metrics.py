"""Prometheus metrics shared by the stage services (names follow Prometheus conventions, prefix vitascope_).

Knows nothing about any stage: a stage observes its own latencies under its `stage` label.
"""
from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

STAGE_LATENCY = Histogram(
    "vitascope_stage_latency_seconds", "Wall time of one pipeline stage for one chunk or request",
    ["stage"], buckets=LATENCY_BUCKETS)
ACTIVE_SESSIONS = Gauge("vitascope_active_sessions", "Sessions this process is generating or decoding for")
TRANSPORT_FALLBACKS = Counter(
    "vitascope_transport_fallbacks_total", "Tensor transfers that used host bytes where CUDA IPC was offered",
    ["peer"])
TRANSPORT_TENSORS = Counter(
    "vitascope_transport_tensors_total", "Tensors sent to another stage, by transport mode (cuda_ipc or host)",
    ["peer", "mode"])
IPC_LEASED_SLOTS = Gauge(
    "vitascope_ipc_leased_slots", "Slots of this process's CUDA IPC pool leased to a consumer and not yet released",
    ["peer"])
GPU_MEMORY = Gauge("vitascope_gpu_memory_bytes", "Bytes allocated by this process on each GPU", ["device"])


def record_gpu_memory() -> None:
    """Set the GPU memory gauge for every visible device (no-op without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return
    for i in range(torch.cuda.device_count()):
        GPU_MEMORY.labels(device=f"cuda:{i}").set(torch.cuda.memory_allocated(i))

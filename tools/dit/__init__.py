"""DiT benchmarks and probes (kernels, all-to-alls, forwards, FP8 and CUDA IPC checks)."""

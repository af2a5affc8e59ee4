"""Moving tensors between stages and capturing them: CUDA IPC pools, the host-bytes fallback, the per-stage
transport handshake and CUDA graphs. Imports torch; the gateway never imports this package."""

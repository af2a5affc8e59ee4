"""Encoder stage core: load the text encoder, turn prompts into `[L, text_dim]` embeddings.

Protocol-neutral (no gRPC here). Prompts are encoded one at a time: the model is one shared device
resource and prompts are short, so a lock keeps them from fighting over the cores/GPU. The encodes, and the warm-up
before them, run on the service's one worker thread (`services.common.threads`).
"""
from __future__ import annotations

import logging
import pathlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from services.common.config import Profile
from services.tensors.cuda_graphs import PromptBuckets
from services.common.errors import InvalidInput, NotReady
from services.common.grpc_server import Stage
from services.encoder.model import EncoderInputError, TextEncoder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Encoded:
    embedding: torch.Tensor
    """[L, text_dim] hidden states in the model dtype."""
    seconds: float
    """Wall time of the encode."""


class EncoderService(Stage):
    """Owns the text encoder of one process."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self.model: TextEncoder | None = None
        self._lock = threading.Lock()
        self.worker = ThreadPoolExecutor(1, "encoder")
        """The one thread of the encodes and of what is sent of them (the servicer's calls) and of the warm-up."""

    def start(self) -> None:
        """Load the text encoder (random weights on the device when the profile says so)."""
        cfg, model = self.profile.encoder, self.profile.model
        dtype = getattr(torch, cfg.dtype)
        if model.random_weights_on_device:
            self.model = TextEncoder.random(model.preset, cfg.device, dtype, max_tokens=cfg.max_tokens)
        else:
            root = pathlib.Path(model.dir) / "MiniMax-H3"
            self.model = TextEncoder.load(root, model.preset, cfg.device, dtype, max_tokens=cfg.max_tokens)
        log.info("text encoder loaded: preset=%s device=%s dtype=%s", model.preset, cfg.device, cfg.dtype)

    def warmup(self) -> None:
        """Capture the CUDA graphs if configured, then run one encode so kernels and allocations are ready; on the
        worker thread, which serves the encodes."""
        self.worker.submit(self._warm_up).result()

    def _warm_up(self) -> None:
        cfg = self.profile.encoder
        if cfg.cuda_graphs:
            self.model.capture_graphs(PromptBuckets(cfg.prompt_buckets))
        self.encode("a warm-up prompt")

    def close(self) -> None:
        """Stop the worker thread."""
        self.worker.shutdown(wait=True)

    def encode(self, prompt: str) -> Encoded:
        """Encode one raw prompt; bad prompts raise InvalidInput naming the problem."""
        if self.model is None:
            raise NotReady("the text encoder is still loading")
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidInput("prompt is empty; send at least one non-blank character")
        with self._lock:
            started = time.perf_counter()
            try:
                if self.model.tokenizer is None:
                    emb = self.model.encode_bytes(prompt)
                else:
                    emb = self.model.encode(prompt)
            except EncoderInputError as exc:
                raise InvalidInput(str(exc)) from None
            if emb.is_cuda:
                torch.cuda.synchronize(emb.device)
            return Encoded(embedding=emb, seconds=time.perf_counter() - started)

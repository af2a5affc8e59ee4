"""DiT stage core: load the base model and the TaoMate LoRA, then open streaming sessions on the runtime.

Protocol-neutral (no gRPC). One active session per DiT group; a session cancelled by its client is given a
moment to release its KV cache before the next one is turned away.
"""
from __future__ import annotations

import logging
import pathlib
import time

import torch

from services.common.config import Profile
from services.common.errors import NoCapacity, NotReady
from services.common.grpc_server import Stage
from services.dit.api import HoldConfig, PromptUpdate, RuntimeConfig, SessionConfig
from services.dit.checkpoint import load_dit
from services.dit.lora import LoRAAdapter
from services.dit.model import PRESETS, build_random
from services.dit.runtime import DiTRuntime, StreamingSession
from services.dit.schedule import AUDIO_SIGMAS, TEACHER_SIGMAS, VIDEO_SIGMAS, model_t

log = logging.getLogger(__name__)

RELEASE_WAIT_SECONDS = 30.0
WARMUP_SEED = 0


def runtime_timesteps() -> list[float]:
    """Every model timestep the runtime uses: student steps, the clean commit, and the audio teacher grid."""
    sigmas = set(VIDEO_SIGMAS) | set(AUDIO_SIGMAS) | set(TEACHER_SIGMAS)
    return sorted({model_t(s) for s in sigmas})


class DiTService:
    """Owns one DiT group's model, adapter and runtime."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self.runtime: DiTRuntime | None = None

    def start(self) -> None:
        """Load (or build on the device) the base DiT, install the LoRA, optionally cache AdaLN."""
        cfg, model_cfg = self.profile.dit, self.profile.model
        args = PRESETS[model_cfg.preset]
        device, dtype = torch.device(cfg.devices[0]), getattr(torch, cfg.dtype)
        root = pathlib.Path(model_cfg.dir)
        started = time.perf_counter()
        if model_cfg.random_weights_on_device:
            model = build_random(args, device, dtype, seed=0)
        else:
            model = load_dit(root / "MiniMax-H3" / "FL2VA" / "transformer", args, device, dtype)
        adapter = None
        if not model_cfg.random_weights_on_device or (root / "TaoMate-H3").is_dir():
            adapter = LoRAAdapter.load(model, root / "TaoMate-H3", dtype=dtype)
        if cfg.adaln_cache:
            report = model.cache_adaln(runtime_timesteps())
            log.info("AdaLN cache: %s", report)
        self.runtime = DiTRuntime(model, RuntimeConfig(
            canvases=cfg.canvas_short_edges, max_text_tokens=self.profile.encoder.max_tokens,
            ulysses_degree=cfg.usp_degree, audio_reset_requests=cfg.audio_reset_requests), adapter)
        log.info("DiT ready in %.1f s: preset=%s devices=%s dtype=%s lora=%s", time.perf_counter() - started,
                 model_cfg.preset, list(cfg.devices), cfg.dtype, adapter is not None)

    def warmup(self) -> None:
        """Generate one phase of a throw-away session at the smallest allowed canvas."""
        edge = min(self.profile.dit.canvas_short_edges)
        text = torch.zeros(8, self.runtime.model.args.text_dim)
        session = self.open(SessionConfig(seed=WARMUP_SEED, width=edge, height=edge), PromptUpdate(text), None)
        try:
            session.next_phase()
        finally:
            session.close()

    def open(self, config: SessionConfig, prompt: PromptUpdate, fallback: PromptUpdate | None) -> StreamingSession:
        """Open the group's one session, waiting briefly for a cancelled predecessor to release its KV."""
        if self.runtime is None:
            raise NotReady("the DiT is still loading")
        deadline = time.monotonic() + RELEASE_WAIT_SECONDS
        while True:
            active = self.runtime.active_session
            if active is None or not active.cancel_token.cancelled or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        return self.runtime.open_session(config, prompt, fallback)

    def hold_config(self, enabled: bool, max_seconds: float) -> HoldConfig:
        """The runtime's hold settings from the wire's (max_seconds 0 = infinite)."""
        return HoldConfig(enabled=enabled, max_seconds=max_seconds or None,
                          poll_seconds=self.profile.dit.hold_poll_seconds)

    @property
    def busy(self) -> bool:
        return self.runtime is not None and self.runtime.active_session is not None


class DiTStage(Stage):
    health_name = "vitascope.dit.v1.DiT"

    def __init__(self, profile: Profile):
        self.service = DiTService(profile)

    def start(self) -> None:
        self.service.start()

    def warmup(self) -> None:
        self.service.warmup()

    def add_to_server(self, server) -> None:
        from services.dit.grpc_server import DiTServicer
        from vitascope.dit.v1 import dit_pb2_grpc

        dit_pb2_grpc.add_DiTServicer_to_server(DiTServicer(self.service), server)


__all__ = ["DiTService", "DiTStage", "NoCapacity", "runtime_timesteps"]

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
from services.tensors.cuda_graphs import PromptBuckets
from services.common.errors import NotReady
from services.common.startup import Steps, report
from services.common.grpc_server import Stage
from services.dit.api import DiTBackend, DiTSession, HoldConfig, PromptUpdate, RuntimeConfig, SessionConfig
from services.dit.model.attention_kernels import prefer_attention_kernels
from services.dit.model.block_graphs import BlockGraphs
from services.dit.model.checkpoint import load_dit
from services.dit.model.fp8 import quantize_linears
from services.dit.stream.geometry import Canvas
from services.dit.group.launch import launch_group
from services.dit.group.orchestration import GroupFailed
from services.dit.model.layout import pack_layout
from services.dit.model.lora import LoRAAdapter, random_adapter_spec
from services.dit.model.network import PRESETS, DiT, FullAttention, build_random
from services.dit.stream.runtime import DiTRuntime, block_graph_shapes
from services.dit.stream.schedule import AUDIO_SIGMAS, TEACHER_SIGMAS, TEACHER_TEXT_SIGMAS, VIDEO_SIGMAS, model_t

log = logging.getLogger(__name__)

RELEASE_WAIT_SECONDS = 30.0
WARMUP_SEED = 0


def runtime_timesteps() -> list[float]:
    """Every model timestep the runtime uses: student steps, the clean commit, and the audio teacher's two grids (its
    audio rows' and its text rows' video clock)."""
    sigmas = set(VIDEO_SIGMAS) | set(AUDIO_SIGMAS) | set(TEACHER_SIGMAS) | set(TEACHER_TEXT_SIGMAS)
    return sorted({model_t(s) for s in sigmas})


def build_runtime(profile: Profile, device: torch.device) -> DiTRuntime:
    """Build one rank's runtime on `device`: base DiT, TaoMate LoRA (merged into the base weights if configured),
    then FP8 and the AdaLN cache if configured; this process's attention kernels.

    Module-level so the DiT group can pickle it to its worker ranks (each sees its GPU as `device`).
    """
    cfg, model_cfg = profile.dit, profile.model
    args = PRESETS[model_cfg.preset]
    dtype = getattr(torch, cfg.dtype)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # streams, compiled kernels and graph pools follow the current device
    prefer_attention_kernels(cfg.attention)
    root = pathlib.Path(model_cfg.dir)
    if model_cfg.random_weights_on_device:
        model = build_random(args, device, dtype, seed=0)
        adapter = LoRAAdapter(model, random_adapter_spec(args, device, seed=1), dtype)
    else:
        model = load_dit(root / "MiniMax-H3" / "FL2VA" / "transformer", args, device, dtype)
        adapter = LoRAAdapter.load(model, root / "TaoMate-H3", dtype=dtype)
    report(log, "TaoMate LoRA", detail="merged into the base" if cfg.merge_lora else "attached")
    if cfg.merge_lora:
        adapter.merge_into_base()
        if cfg.fp8:
            log.warning("dit.merge_lora with dit.fp8: the LoRA is quantised with the base weights, which blurred the "
                        "video about 4.7x in the published serving stack; check the output on your checkpoint")
    if cfg.fp8:
        fp8 = quantize_linears(model)  # after LoRA (and its merge): the side branch stays BF16
        report(log, "FP8", detail=f"{len(fp8.quantized)} block linears quantised, {len(fp8.kept)} kept in BF16, "
                                  f"{fp8.bytes_before / 2**30:.1f} -> {fp8.bytes_after / 2**30:.1f} GiB")
    if cfg.adaln_cache:
        report(log, "AdaLN cache", detail=str(model.cache_adaln(runtime_timesteps())))
    if device.type == "cuda":
        compile_block_regions(model, adapter)
    block_graphs = cfg.cuda_graphs and cfg.reuse_text_kv and device.type == "cuda"
    runtime = DiTRuntime(model, RuntimeConfig(
        canvases=cfg.canvas_short_edges, max_text_tokens=profile.encoder.max_tokens,
        ulysses_degree=cfg.usp_degree, audio_reset_requests=cfg.audio_reset_requests,
        reuse_text_kv=cfg.reuse_text_kv, renormalise_anchor=cfg.renormalise_anchor,
        text_buckets=cfg.prompt_buckets if block_graphs else ()), adapter)
    runtime.teacher.overlap = cfg.teacher_overlap
    if cfg.cuda_graphs and cfg.usp_degree == 1:  # a Ulysses group captures them once it has formed (launch)
        runtime.teacher.capture_graphs(PromptBuckets(cfg.prompt_buckets))
    if block_graphs:  # no collective inside: captured right away
        graphs = BlockGraphs(model, adapter, device, cfg.usp_degree)
        shapes = block_graph_shapes(profile_canvases(profile), cfg.usp_degree, cfg.prompt_buckets)
        captured = Steps(log, "block CUDA graphs of the student and commit forwards", len(shapes))
        for rows, slots in shapes:
            graphs.capture(rows, slots)
            captured.tick(f"{rows} rows on this rank, {slots} timestep slots")
        graphs.seal()
        model.block_graphs = graphs
    return runtime


def profile_canvases(profile: Profile) -> list[Canvas]:
    """The canvases the profile's gateway admits whose short edge the DiT serves."""
    return [Canvas(w, h) for w, h in profile.gateway.allowed_canvases if min(w, h) in profile.dit.canvas_short_edges]


def compile_block_regions(model: DiT, adapter: LoRAAdapter) -> None:
    """Compile every variant of the block regions here, on this rank alone, before any session.

    Compiling takes minutes on first use; inside a lock-step step of a Ulysses group one rank would then hold the
    others at a collective past its timeout. Shapes are dynamic, so small forwards cover every phase size; the
    variants are the LoRA on (students, commit) and off (teacher), and a layout of one timestep (the clean commit,
    the first teacher) or several (the compiler specialises a size of 1). With the LoRA merged, the side branch
    runs in the teacher's variant instead of the students'.
    """
    dev = model.condition_proj.weight.device
    tt, audio, video = 13, 7, 24  # no two row counts equal
    inputs = (torch.zeros(video, model.args.video_row_dim, device=dev),
              torch.zeros(2 * audio, model.args.audio_channels, device=dev),
              torch.zeros(tt, model.args.text_dim, device=dev, dtype=model.dtype))
    compiled = Steps(log, "block-region compiles (LoRA on and off, one and several timesteps)", 4)
    for video_t, audio_t in ((0.0, 0.0), (model_t(VIDEO_SIGMAS[1]), model_t(AUDIO_SIGMAS[1]))):
        layout = pack_layout(text_len=tt, audio_len_per_channel=audio, video_rows=video,
                             positions_text=torch.zeros(tt, 3), positions_audio=torch.zeros(2 * audio, 3),
                             positions_video=torch.zeros(video, 3), video_t=video_t, audio_t=audio_t).to(dev)
        with torch.no_grad():
            model(*inputs, layout, FullAttention(layout))
            compiled.tick("LoRA on")
            with adapter.suspended():
                model(*inputs, layout, FullAttention(layout))
            compiled.tick("LoRA off")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class DiTService(Stage):
    """Owns one DiT group's runtime: in this process (USP1) or rank 0 of a Ulysses group (USP2/USP4)."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self.runtime: DiTBackend | None = None
        """This process's `DiTRuntime`, or rank 0's `DiTGroup` (None while loading)."""

    def start(self) -> None:
        """Build the runtime, or launch the Ulysses group whose rank 0 runs here."""
        cfg = self.profile.dit
        started = time.perf_counter()
        if cfg.usp_degree == 1:
            self.runtime = build_runtime(self.profile, torch.device(cfg.devices[0]))
        else:
            self.runtime = launch_group(self.profile, build_runtime)
        log.info("DiT ready in %.1f s: preset=%s devices=%s dtype=%s fp8=%s", time.perf_counter() - started,
                 self.profile.model.preset, list(cfg.devices), cfg.dtype, cfg.fp8)

    @property
    def failed(self) -> bool:
        """True once a rank of the group died or diverged (the service must report NOT_SERVING)."""
        return self.runtime is not None and self.runtime.failed

    def prepare_worker(self) -> None:
        """On a CPU, start this executor thread's OpenMP team now: its phases run torch on these threads, and a team
        started while serving is a thread more (a sum this long runs as one parallel region)."""
        if torch.device(self.profile.dit.devices[0]).type == "cpu":
            torch.ones(1 << 20).sum()

    def close(self) -> None:
        """Stop the group's worker ranks."""
        if self.runtime is not None:
            self.runtime.shutdown()

    def warmup(self) -> None:
        """Generate one phase of a throw-away session at the smallest allowed canvas."""
        edge = min(self.profile.dit.canvas_short_edges)
        text = torch.zeros(8, self.runtime.model.args.text_dim)
        session = self.open(SessionConfig(seed=WARMUP_SEED, width=edge, height=edge), PromptUpdate(text), None)
        try:
            session.next_phase()
        finally:
            session.close()

    def open(self, config: SessionConfig, prompt: PromptUpdate, fallback: PromptUpdate | None) -> DiTSession:
        """Open the group's one session, waiting briefly for a cancelled predecessor to release its KV."""
        if self.runtime is None:
            raise NotReady("the DiT is still loading")
        if self.failed:
            raise GroupFailed("the DiT group is down; restart the service")
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

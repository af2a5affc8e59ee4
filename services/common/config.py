"""Deployment profile: typed, validated configuration loaded from one YAML file per profile.

Torch-free, so the gateway can load it too. YAML is read only by `load_profile`, called from each
service's `main()`; everything below receives the dataclasses. Facts two stages share (the canvases the deployment
serves: the gateway admits them, the DiT captures graphs and the VAE compiles for them) are typed fields here, so no
service reads another service's package for its configuration.
"""
from __future__ import annotations

import dataclasses
import pathlib
from urllib.parse import urlsplit
from dataclasses import dataclass, field
from typing import Any

import yaml

from services.common.media import VIDEO_FPS

PRESETS = ("tiny", "full")
DTYPES = ("float32", "bfloat16")
ATTENTION_KERNELS = ("default", "cudnn", "fa4")
RENORMALISE_ANCHORS = ("session", "prompt")
"""What `dit.renormalise_anchor` may name (services.dit.stream.runtime)."""
PROMPT_BUCKETS = (128, 256, 384, 512)
"""Default prompt lengths (tokens) the CUDA graphs are captured for."""
KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True)
class ModelConfig:
    preset: str
    """Model dims: `tiny` (CPU tests and demo) or `full` (the real MiniMax-H3 / TaoMate-H3 dims)."""
    dir: str
    """Root of the checkpoint tree (MiniMax-H3 layout plus `TaoMate-H3/` for the LoRA)."""
    write_if_missing: bool = False
    """Write a random-weight checkpoint of `preset` into `dir` on first start (tiny demo only)."""
    random_weights_on_device: bool = False
    """Build the `full` model with random weights on the device, no files (GPU benchmarks)."""

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"model.preset={self.preset!r}: use one of {PRESETS}")


@dataclass(frozen=True)
class Endpoints:
    encoder: str = "127.0.0.1:50051"
    """host:port of the encoder gRPC server."""
    dit: str = "127.0.0.1:50052"
    """host:port of the DiT gRPC server (rank 0)."""
    vae: str = "127.0.0.1:50053"
    """host:port of the VAE gRPC server."""

    def port_of(self, name: str) -> int:
        """The port part of one endpoint."""
        return int(getattr(self, name).rsplit(":", 1)[1])

    def host_of(self, name: str) -> str:
        """The host part of one endpoint: where that stage listens (loopback in every shipped profile)."""
        return getattr(self, name).rsplit(":", 1)[0].strip("[]")


@dataclass(frozen=True)
class EncoderConfig:
    device: str = "cpu"
    """torch device of the text encoder."""
    dtype: str = "float32"
    """Compute dtype: float32 or bfloat16."""
    max_tokens: int = 512
    """Longest prompt in tokens; longer prompts are rejected."""
    metrics_port: int = 9101
    """Port of the Prometheus /metrics endpoint (0 disables it)."""
    cuda_ipc: bool = True
    """Offer CUDA IPC to the DiT when the encoder runs on CUDA: an embedding then goes as one slot of the encoder's
    exported device pool when the DiT runs on the same machine and sees that GPU (else host bytes, counted in
    vitascope_transport_fallbacks_total). False always sends host bytes."""
    ipc_slot_mib: int = 12
    """Size of one slot of the encoder's CUDA IPC pool in MiB (an even number). One slot holds one embedding:
    [max_tokens, 5120] is 5 MiB in bfloat16 and 10 MiB in float32 at 512 tokens; larger ones go as host bytes."""
    ipc_slots: int = 4
    """Slots of the pool: embeddings sent but not yet copied out by the DiT (a session's prompt, its fallback and
    updates in flight); when all are out, embeddings go as host bytes (a counted fallback)."""
    cuda_graphs: bool = False
    """Capture the text stack as CUDA graphs at start-up, one per `prompt_buckets` size (CUDA device only); a
    prompt is padded at the end to its bucket, which a causal stack ignores."""
    prompt_buckets: tuple[int, ...] = PROMPT_BUCKETS
    """Prompt lengths (tokens) the graphs are captured for, increasing; the largest must hold max_tokens."""
    memory_gib: float = 0
    """This stage's share of `device`'s memory in GiB (0: none declared), checked at start-up with the other
    stages' shares on that GPU (services/common/gpu_budget.py)."""

    def __post_init__(self):
        _check_dtype("encoder.dtype", self.dtype)
        _check_budget("encoder.memory_gib", self.memory_gib)
        if self.max_tokens < 1:
            raise ValueError(f"encoder.max_tokens={self.max_tokens}: must be ≥ 1")
        _check_ipc("encoder", self.cuda_ipc, self.ipc_slot_mib, self.ipc_slots, min_slots=1)
        object.__setattr__(self, "prompt_buckets", tuple(self.prompt_buckets))
        _check_graphs("encoder", self.cuda_graphs, (self.device,), self.prompt_buckets)
        if self.cuda_graphs and self.prompt_buckets[-1] < self.max_tokens:
            raise ValueError(f"encoder.prompt_buckets={list(self.prompt_buckets)}: the largest bucket must hold "
                             f"encoder.max_tokens={self.max_tokens}")


@dataclass(frozen=True)
class DiTConfig:
    devices: tuple[str, ...] = ("cpu",)
    """One torch device per Ulysses rank; its length is the USP degree (1, 2 or 4)."""
    dtype: str = "float32"
    """Compute dtype of the DiT and its KV cache."""
    canvas_short_edges: tuple[int, ...] = (192, 256)
    """Allowed canvas short edges in pixels (both sides must be multiples of 32); others are rejected."""
    fp8: bool = False
    """FP8 per-channel weights and per-token activations on the DiT linears (H100/H200 only)."""
    adaln_cache: bool = False
    """Precompute the AdaLN modulations of the fixed runtime timesteps and drop the AdaLN weights."""
    merge_lora: bool = False
    """Fold the LoRA into the base weights (before FP8): the students and the commit then run one GEMM per linear,
    and the audio teacher subtracts the LoRA side branch instead of the students adding it. Same memory.
    With `fp8` the merged weights are quantised together, which the published serving stack measured to blur the
    video about 4.7x on the real checkpoint; so the FP8 profile keeps the LoRA as a BF16 side branch."""
    attention: str = "default"
    """Attention kernels of every DiT rank: "default" (torch's SDPA, its own choice), "cudnn" (SDPA with cuDNN's
    attention first, the fastest of SDPA's on Hopper at these shapes; the others stay as fallbacks for inputs a
    kernel cannot take) or "fa4" (FlashAttention 4 for every unmasked attention on CUDA, 1.12-1.17x cuDNN's speed at
    these shapes on an H200; the masked ones go to SDPA as with "cudnn"; needs the flash-attn-4 package)."""
    audio_reset_requests: int = 12
    """Drop the audio KV history every this many requests."""
    reuse_text_kv: bool = True
    """Run a request's text rows once per text timestep (its 3 student steps and the commit) and reuse their K/V
    in its later phases; False runs them in every forward (~5% more DiT FLOPs per steady request at 480x864)."""
    renormalise_anchor: str = "session"
    """Whose statistics each phase's clean video is renormalised to: "session" (the session's first phase, the
    official runtime) or "prompt" (the first phase of the request where the active prompt began: a prompt update
    can then change the colours the first prompt set; with "session" the tiny model keeps them, docs/decisions.md)."""
    hold_poll_seconds: float = 0.02
    """How often a held session looks for a newer prompt or a cancel."""
    max_phases_ahead: int = 2
    """Flow control: phases a session may generate before the consumer acknowledges the oldest (≥ 1).

    The gateway acks a phase once the VAE returned its chunk, so prompt updates land at the next request
    boundary after what the client has received instead of wherever the DiT has run ahead to."""
    metrics_port: int = 9102
    """Port of the Prometheus /metrics endpoint (0 disables it)."""
    cuda_graphs: bool = False
    """Capture CUDA graphs at start-up (CUDA devices only): the audio teacher's steps, its prompts then padded to
    `prompt_buckets` with the padding masked out; and, with `reuse_text_kv`, the block stack of the students and
    commits that run without text rows, per phase shape of the gateway's canvases, piecewise between the attention
    calls (services/dit/model/block_graphs.py). No capture happens while serving."""
    prompt_buckets: tuple[int, ...] = PROMPT_BUCKETS
    """Prompt lengths (tokens) the graphs are captured for, increasing; the largest must hold encoder.max_tokens.
    Each bucket costs 27 teacher graphs (9 steps x 3 audio shapes) and about 6 s of start-up."""
    teacher_sharded: bool = False
    """Run the audio teacher's graphed steps sharded over the Ulysses group, the all-to-alls captured inside the
    graphs (needs `cuda_graphs` and 2+ devices): 0.42 instead of ~0.5 s per request on 2xH200. The cost: NCCL work
    inside a graph cannot be aborted, so a rank that dies during the teacher leaves GPU 0's stream blocked; the
    service still reports NOT_SERVING, but only a restart of its process frees it. Off: every rank runs the
    teacher whole and a dead rank fails the group cleanly."""
    teacher_staged: bool = False
    """Split the audio teacher's blocks over the Ulysses group's ranks, one contiguous stage per rank (needs 2+
    devices, not `teacher_sharded`): a step's hidden rows go from rank to rank through host memory, on a gloo group
    of the teacher's own, between the graph replays, so a dead rank still fails the group cleanly. Each GPU then
    does 1/N of the teacher's work instead of all of it; its steps take as long as before plus the hand-overs (a
    few ms each). On 2xH200: 0.06-0.2 s less DiT time per request, 0.02-0.1 s less to the first chunk (see
    docs/decisions.md, 'Teacher staged over the ranks'). Off: every rank runs the whole teacher."""
    teacher_overlap: bool = False
    """Replay the audio teacher's graphs on their own CUDA stream, from a worker thread, beside the previous phase's
    commit and the first student step of each request (which needs no teacher state); the next steps wait for the
    states they use. Needs `cuda_graphs` and not `teacher_sharded` (its all-to-alls would interleave with the
    students'). Off: the teacher runs before the students."""
    cuda_ipc: bool = True
    """Offer CUDA IPC to the VAE when the DiT's rank 0 runs on CUDA: latents then go through one exported device
    pool on `devices[0]` when the VAE runs on the same machine and sees that GPU (else host bytes, counted in
    vitascope_transport_fallbacks_total). False always sends host bytes."""
    ipc_slot_mib: int = 16
    """Size of one slot of the CUDA IPC pool in MiB (an even number: slots are 2 MiB aligned). One slot holds one
    tensor: a phase's video latents are at most [12, 24, H/16, W/16] float32 (1.8 MiB at 480x864, 9.0 MiB at
    1088x1920); a tensor larger than a slot goes as host bytes (a counted fallback)."""
    ipc_slots: int = 0
    """Slots of the pool; 0 means 2 x (max_phases_ahead + 1): the video and audio latents of every phase the
    VAE may hold unreleased, plus one phase. See `ipc_pool_slots`."""
    memory_gib: float = 0
    """Each rank's share of its device's memory in GiB (0: none declared), checked at start-up with the other
    stages' shares on that GPU (services/common/gpu_budget.py)."""

    def __post_init__(self):
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "canvas_short_edges", tuple(self.canvas_short_edges))
        object.__setattr__(self, "prompt_buckets", tuple(self.prompt_buckets))
        _check_dtype("dit.dtype", self.dtype)
        _check_budget("dit.memory_gib", self.memory_gib)
        if len(self.devices) not in (1, 2, 4):
            raise ValueError(f"dit.devices={list(self.devices)}: the USP degree must be 1, 2 or 4")
        if not self.canvas_short_edges:
            raise ValueError("dit.canvas_short_edges is empty: list at least one")
        if self.max_phases_ahead < 1:
            raise ValueError(f"dit.max_phases_ahead={self.max_phases_ahead}: must be ≥ 1")
        for edge in self.canvas_short_edges:
            if edge <= 0 or edge % 32:
                raise ValueError(f"dit.canvas_short_edges entry {edge}: must be a positive multiple of 32")
        _check_graphs("dit", self.cuda_graphs, self.devices, self.prompt_buckets)
        if self.teacher_sharded and not (self.cuda_graphs and len(self.devices) > 1):
            raise ValueError("dit.teacher_sharded needs dit.cuda_graphs and 2 or 4 dit.devices (eager teacher steps "
                             "are host-bound and run whole on every rank)")
        if self.teacher_staged and (len(self.devices) < 2 or self.teacher_sharded):
            raise ValueError("dit.teacher_staged needs 2 or 4 dit.devices and not dit.teacher_sharded (the teacher's "
                             "blocks are split over the ranks or its rows are, not both)")
        if self.teacher_overlap and (not self.cuda_graphs or self.teacher_sharded):
            raise ValueError("dit.teacher_overlap needs dit.cuda_graphs and not dit.teacher_sharded (only whole, "
                             "graphed teacher steps run beside the students)")
        for name in ("merge_lora", "reuse_text_kv", "teacher_staged"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"dit.{name}={getattr(self, name)!r}: must be true or false")
        if self.renormalise_anchor not in RENORMALISE_ANCHORS:
            raise ValueError(f"dit.renormalise_anchor={self.renormalise_anchor!r}: use one of {RENORMALISE_ANCHORS}")
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"dit.attention={self.attention!r}: use one of {ATTENTION_KERNELS}")
        _check_ipc("dit", self.cuda_ipc, self.ipc_slot_mib, self.ipc_slots or 2, min_slots=2)

    @property
    def usp_degree(self) -> int:
        return len(self.devices)

    @property
    def ipc_pool_slots(self) -> int:
        """Slots of the CUDA IPC pool: `ipc_slots`, or 2 x (max_phases_ahead + 1) when that is 0."""
        return self.ipc_slots or 2 * (self.max_phases_ahead + 1)


@dataclass(frozen=True)
class VAEConfig:
    device: str = "cpu"
    """torch device of the video and audio decoders."""
    dtype: str = "float32"
    """Compute dtype of the decoders."""
    x264_preset: str = "ultrafast"
    """libx264 preset of the muxer."""
    metrics_port: int = 9103
    """Port of the Prometheus /metrics endpoint (0 disables it)."""
    tile_overlap_px: int = 64
    """Minimum overlap of neighbouring 256 px video decode tiles, a multiple of 16 px. The release uses 64 (a
    480x864 clip is 3 x 5 = 15 tiles); the published realtime configs use 32 (2 x 4 = 8 tiles, 47% less ViT work)."""
    tile_devices: tuple[str, ...] = ()
    """Further devices that each hold a copy of the video decoder and decode an equal share of every phase's tiles
    beside `device` (e.g. the other GPU of a usp2 node, so both DiT ranks lose the same time to the decode)."""
    compile_blocks: bool = False
    """torch.compile the video decoder's ViT blocks (CUDA devices only): a third less decode time on an H200, with
    frames within BF16 rounding of the eager decode instead of bitwise equal to it. Every phase shape of the
    allowed canvases is compiled at start-up (the warm-up), so nothing compiles while serving."""
    cuda_graphs: bool = False
    """Capture the audio decoder (a vocoder of many small kernels, decoded in the VAE's audio thread) as one CUDA
    graph per phase size at start-up (CUDA only); the replay equals the eager decode bitwise."""
    memory_gib: float = 0
    """This stage's share of `device`'s memory in GiB (0: none declared): both decoders, the tiles decoded there,
    the muxer's frames. Checked at start-up with the other stages' shares (services/common/gpu_budget.py)."""
    tile_memory_gib: float = 0
    """Its share of each of `tile_devices`' memory in GiB (0: none declared): a video decoder's copy and its tiles."""
    audio_right_context: int | str = 0
    """Audio latents (40 a second) of true right context every streamed sample is decoded with, at least. 0: what
    the video's held-back frames give at no extra A/V latency (each phase's last 5 frames, 208 ms, about 8 latents:
    the audio is cut where the emitted video ends). More holds the audio of a phase's last N latents for the next
    phase, N / 40 s - 208 ms behind its video; "exact" is the decoder's receptive radius (33 latents on the release),
    each sample then equal to the whole-session decode. Figures: docs/decisions.md."""

    def __post_init__(self):
        _check_dtype("vae.dtype", self.dtype)
        _check_budget("vae.memory_gib", self.memory_gib)
        _check_budget("vae.tile_memory_gib", self.tile_memory_gib)
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"vae.cuda_graphs is true but vae.device is {self.device!r}: graphs need CUDA")
        if not isinstance(self.compile_blocks, bool):
            raise ValueError(f"vae.compile_blocks={self.compile_blocks!r}: must be true or false")
        if self.compile_blocks and not all(d.startswith("cuda") for d in (self.device, *self.tile_devices)):
            raise ValueError(f"vae.compile_blocks needs CUDA devices, got vae.device={self.device!r} and "
                             f"vae.tile_devices={list(self.tile_devices)}")
        if not isinstance(self.tile_overlap_px, int) or not 16 <= self.tile_overlap_px < 256 \
                or self.tile_overlap_px % 16:
            raise ValueError(f"vae.tile_overlap_px={self.tile_overlap_px!r}: must be a multiple of 16 from 16 to 240")
        if self.audio_right_context != "exact" and (not isinstance(self.audio_right_context, int) or isinstance(
                self.audio_right_context, bool) or not 0 <= self.audio_right_context <= 64):
            raise ValueError(f"vae.audio_right_context={self.audio_right_context!r}: must be a whole number of audio "
                             "latents from 0 to 64, or \"exact\" (the decoder's receptive radius)")
        object.__setattr__(self, "tile_devices", tuple(self.tile_devices))
        if self.device in self.tile_devices or len(set(self.tile_devices)) != len(self.tile_devices):
            raise ValueError(f"vae.tile_devices={list(self.tile_devices)}: each must differ from vae.device="
                             f"{self.device!r} and from the others")


@dataclass(frozen=True)
class GatewayAuthConfig:
    """Who may use the gateway (`gateway.auth`): tokens, browser origins, per-address limits (services/gateway/access.py)."""

    enabled: bool = False
    """Require a token on the realtime websocket and the watch websocket (and on /metrics with
    `protect_metrics`)."""
    tokens_file: str = ""
    """A file with one token per line (`#` starts a comment); read once at start-up."""
    tokens_env: str = ""
    """The name of an environment variable holding comma-separated tokens; read once at start-up."""
    viewer_tokens_file: str = ""
    """A file of viewer tokens (same format): they may watch a session (its watch websocket) but not start one.
    The director tokens above may watch too; without viewer tokens only they can."""
    viewer_tokens_env: str = ""
    """The name of an environment variable holding comma-separated viewer tokens; read once at start-up."""
    protect_metrics: bool = False
    """Require a token on /metrics too (a Prometheus scrape then sends it as a bearer token)."""
    allowed_origins: tuple[str, ...] = ()
    """Browser origins allowed besides the page's own and loopback, e.g. `https://shop.example`."""
    max_connections_per_address: int = 16
    """Open websockets one client address may hold."""
    starts_per_minute_per_address: int = 30
    """`session.start` messages one client address may send in any 60 s."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_origins", tuple(o.rstrip("/") for o in self.allowed_origins))
        if self.enabled and not (self.tokens_file or self.tokens_env):
            raise ValueError("gateway.auth.enabled needs gateway.auth.tokens_file or gateway.auth.tokens_env")
        if self.max_connections_per_address < 1 or self.starts_per_minute_per_address < 1:
            raise ValueError(f"gateway.auth limits max_connections_per_address={self.max_connections_per_address}, "
                             f"starts_per_minute_per_address={self.starts_per_minute_per_address}: must be ≥ 1")
        for origin in self.allowed_origins:
            parts = urlsplit(origin)
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.path:
                raise ValueError(f"gateway.auth.allowed_origins entry {origin!r}: write scheme://host[:port]")


@dataclass(frozen=True)
class GatewayBroadcastConfig:
    """How a live session is shared with viewers (`gateway.broadcast`; services/gateway/broadcast.py)."""

    viewer_queue_chunks: int = 4
    """Chunks one viewer may have waiting to be sent; a chunk arriving at a full queue makes that viewer skip
    ahead to it (the queue is emptied first; every chunk opens with a keyframe, so its stream stays decodable)."""
    viewer_max_skips: int = 3
    """Skips ahead a viewer may make without once emptying its queue; one more drops it (`viewer_too_slow`)."""
    max_viewers: int = 500
    """Viewers one session may have at once (websocket watchers; HLS readers are not counted); one more is
    refused with HTTP 503 `too_many_viewers`."""
    retain_s: float = 30.0
    """Media seconds of a session's newest chunks kept in memory for late joiners and the HLS window (at least
    the newest chunk is always kept)."""
    linger_s: float = 30.0
    """Seconds an ended session's broadcast stays readable (late HLS readers then see the end of the list)."""

    def __post_init__(self) -> None:
        for name in ("viewer_queue_chunks", "max_viewers"):
            if getattr(self, name) < 1:
                raise ValueError(f"gateway.broadcast.{name}={getattr(self, name)}: must be >= 1")
        if self.viewer_max_skips < 0:
            raise ValueError(f"gateway.broadcast.viewer_max_skips={self.viewer_max_skips}: must be >= 0 "
                             "(0 drops a viewer at its first skip)")
        for name in ("retain_s", "linger_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"gateway.broadcast.{name}={getattr(self, name)}: must be > 0 seconds")


@dataclass(frozen=True)
class GatewayConfig:
    """The realtime websocket gateway's section; its canvases are also what the DiT and the VAE prepare for."""

    host: str = "127.0.0.1"
    """Address the HTTP server binds."""
    port: int = 8000
    """TCP port of HTTP, `/v1/realtime/video`, `/healthz` and `/metrics` (0 picks a free port)."""
    model: str = "TaoMate-H3"
    """Served model name; a `session.start` naming another model is rejected (`model_mismatch`)."""
    num_slots: int = 1
    """Sessions generating at once (one per DiT group)."""
    queue_limit: int = 8
    """Sessions allowed to wait for a slot; one more gets `queue_full`. 0 disables waiting."""
    start_timeout_s: float = 10.0
    """Seconds a new connection has to send `session.start`."""
    stall_timeout_s: float = 60.0
    """Seconds without a chunk and without `session.ping` before an active session is aborted."""
    send_timeout_s: float = 30.0
    """Seconds one outbound message may take to reach the socket; a client that reads nothing for that long
    (TCP backpressure) is dropped, so it cannot hold a slot or a queue place."""
    heartbeat_s: float = 20.0
    """Seconds between websocket pings; a peer that has not answered one within half of that is dropped (a dead
    network path, or a client that stopped reading while it waits in the queue and so is sent next to nothing)."""
    max_start_bytes: int = 4 * MiB
    """Largest accepted `session.start` text frame (UTF-8 bytes)."""
    max_interaction_bytes: int = 128 * KiB
    """Largest accepted text frame of any other message type."""
    max_frame_bytes: int = 8 * MiB
    """Transport hard limit: a larger frame closes the connection with code 1009 and no reply."""
    max_prompt_chars: int = 2000
    """Longest accepted prompt, in characters."""
    max_pending_updates: int = 16
    """Prompt updates a session may have waiting for the backend; one more gets `too_many_updates`.
    Only the newest pending update reaches generation at a request boundary, so more is never useful."""
    allowed_canvases: tuple[tuple[int, int], ...] = ((480, 864),)
    """Accepted (width, height) pairs, positive even ints (YAML: a list of [width, height]); the canvas is fixed
    per deployment. The DiT captures its block graphs for those whose short edge is in `dit.canvas_short_edges`,
    and the VAE compiles its ViT blocks for every one."""
    default_canvas: tuple[int, int] = (480, 864)
    """(width, height) used when `session.start` names neither; one of `allowed_canvases`."""
    fps: int = VIDEO_FPS
    """Frame rate of the served model; a `session.start` asking for another rate is rejected."""
    default_seed: int = 8301
    """Seed used when `session.start` carries none."""
    queue_poll_s: float = 1.0
    """Seconds between stall checks and queue-position refreshes."""
    drain_timeout_s: float = 5.0
    """Seconds to wait for the pipeline's last chunks after `session.stop` before giving up."""
    static_dir: str | None = None
    """Directory served at `/` (None: the page shipped in `services/gateway/static`)."""
    auth: GatewayAuthConfig = field(default_factory=GatewayAuthConfig)
    """Tokens, allowed browser origins and per-address limits (off by default: no token needed)."""
    backend_wait_s: float = 30.0
    """Seconds a new `session.start` waits for a stage that is down (restarting) before it gets
    `backend_unavailable` naming the stage."""
    broadcast: GatewayBroadcastConfig = field(default_factory=GatewayBroadcastConfig)
    """Viewers of a live session: their queues, how many, and how much of the stream is kept for them."""
    hls_part_target_s: float = 1.5
    """LL-HLS `PART-TARGET`: at least the longest chunk (a 34-frame phase, 1.417 s at 24 fps); players hold back
    three of it from the live edge."""
    hls_target_duration_s: int = 5
    """LL-HLS `EXT-X-TARGETDURATION`: at least the longest 5 s request, rounded (124 frames, 5.17 s, with the
    trailer's frames)."""
    recordings_dir: str | None = None
    """Directory each session's stream is recorded into, as a progressive MP4 once the session ends (None: no
    recordings). Listed at `/v1/recordings`, behind the gateway's tokens."""
    recordings_max_count: int | None = None
    """Keep at most this many recordings (the oldest go first; None: no limit)."""
    recordings_max_age_s: float | None = None
    """Delete recordings older than this (None: no limit)."""

    def __post_init__(self) -> None:
        if isinstance(self.auth, dict):
            object.__setattr__(self, "auth", section(GatewayAuthConfig, self.auth, "gateway.auth"))
        if isinstance(self.broadcast, dict):
            object.__setattr__(self, "broadcast", section(GatewayBroadcastConfig, self.broadcast,
                                                          "gateway.broadcast"))
        object.__setattr__(self, "allowed_canvases", tuple(_canvas("gateway.allowed_canvases entry", c)
                                                           for c in _pairs(self.allowed_canvases)))
        object.__setattr__(self, "default_canvas", _canvas("gateway.default_canvas", self.default_canvas))
        if not self.allowed_canvases:
            raise ValueError("gateway.allowed_canvases is empty: list at least one [width, height]")
        if self.default_canvas not in self.allowed_canvases:
            raise ValueError(f"gateway.default_canvas={list(self.default_canvas)} is not in gateway.allowed_canvases "
                             f"{[list(c) for c in self.allowed_canvases]}: pick one of them or add it")
        if not self.host:
            raise ValueError("gateway.host is empty: use e.g. '127.0.0.1' or '0.0.0.0'")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"gateway.port={self.port}: must be in 0..65535 (0 picks a free port)")
        if not self.model:
            raise ValueError("gateway.model is empty: set the served model name")
        for name in ("num_slots", "max_pending_updates", "max_prompt_chars", "fps"):
            if getattr(self, name) < 1:
                raise ValueError(f"gateway.{name}={getattr(self, name)}: must be >= 1")
        if self.queue_limit < 0:
            raise ValueError(f"gateway.queue_limit={self.queue_limit}: must be >= 0 (0 disables waiting)")
        for name in ("start_timeout_s", "stall_timeout_s", "send_timeout_s", "heartbeat_s", "queue_poll_s",
                     "drain_timeout_s", "backend_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"gateway.{name}={getattr(self, name)}: must be > 0 seconds")
        if self.max_start_bytes < 1 or self.max_interaction_bytes < 1:
            raise ValueError(f"gateway.max_start_bytes={self.max_start_bytes}, gateway.max_interaction_bytes="
                             f"{self.max_interaction_bytes}: message limits must be >= 1 byte")
        if self.max_frame_bytes < max(self.max_start_bytes, self.max_interaction_bytes):
            raise ValueError(f"gateway.max_frame_bytes={self.max_frame_bytes}: must be >= max_start_bytes "
                             f"({self.max_start_bytes}) and max_interaction_bytes ({self.max_interaction_bytes})")
        if not (isinstance(self.hls_target_duration_s, int) and not isinstance(self.hls_target_duration_s, bool)
                and 0 < self.hls_part_target_s <= self.hls_target_duration_s):
            raise ValueError(f"gateway.hls_part_target_s={self.hls_part_target_s}, hls_target_duration_s="
                             f"{self.hls_target_duration_s}: need 0 < part target <= target duration, a whole "
                             "number of seconds")
        if self.recordings_dir is not None and not str(self.recordings_dir).strip():
            raise ValueError("gateway.recordings_dir is empty: name a directory, or leave it out (no recordings)")
        if self.recordings_max_count is not None and (
                not isinstance(self.recordings_max_count, int) or self.recordings_max_count < 1):
            raise ValueError(f"gateway.recordings_max_count={self.recordings_max_count!r}: must be an int >= 1 "
                             "(or absent: no limit)")
        if self.recordings_max_age_s is not None and not self.recordings_max_age_s > 0:
            raise ValueError(f"gateway.recordings_max_age_s={self.recordings_max_age_s!r}: must be > 0 seconds "
                             "(or absent: no limit)")
        if self.recordings_dir is None and (self.recordings_max_count is not None
                                            or self.recordings_max_age_s is not None):
            raise ValueError("gateway.recordings_max_count / recordings_max_age_s are set without "
                             "gateway.recordings_dir: set the directory too, or drop them")


def _pairs(value: Any) -> tuple:
    """`value` as a tuple of entries (a YAML list of lists becomes a tuple); anything else is an error."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"gateway.allowed_canvases={value!r}: must be a list of [width, height] pairs")
    return tuple(value)


def _canvas(name: str, value: Any) -> tuple[int, int]:
    """One (width, height) of positive even ints, as a tuple; `name` and the value are in the error."""
    if not isinstance(value, (list, tuple)) or len(value) != 2 \
            or any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v % 2 for v in value):
        raise ValueError(f"{name} {value!r}: must be a [width, height] pair of positive even ints, e.g. [864, 480]")
    return (value[0], value[1])


@dataclass(frozen=True)
class Profile:
    name: str
    model: ModelConfig
    endpoints: Endpoints = field(default_factory=Endpoints)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    dit: DiTConfig = field(default_factory=DiTConfig)
    vae: VAEConfig = field(default_factory=VAEConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    """The gateway's section, with the canvases the DiT and the VAE also read."""
    path: str = ""
    """The YAML file this profile came from."""

    def __post_init__(self):
        if self.dit.cuda_graphs and self.dit.prompt_buckets[-1] < self.encoder.max_tokens:
            raise ValueError(f"dit.prompt_buckets={list(self.dit.prompt_buckets)}: the largest bucket must hold "
                             f"encoder.max_tokens={self.encoder.max_tokens}")


def _check_ipc(section_name: str, enabled: bool, slot_mib: int, slots: int, min_slots: int) -> None:
    """Validate a section's CUDA IPC pool fields (`slots` after resolving an automatic 0)."""
    if not isinstance(enabled, bool):
        raise ValueError(f"{section_name}.cuda_ipc={enabled!r}: must be true or false")
    if not isinstance(slot_mib, int) or isinstance(slot_mib, bool) or slot_mib < 2 or slot_mib % 2:
        raise ValueError(f"{section_name}.ipc_slot_mib={slot_mib!r}: must be an even number of MiB >= 2")
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < min_slots:
        automatic = " or 0 (automatic)" if section_name == "dit" else ""
        raise ValueError(f"{section_name}.ipc_slots={slots!r}: must be an int >= {min_slots}{automatic}")


def _check_graphs(section_name: str, enabled: bool, devices: tuple[str, ...], buckets: tuple[int, ...]) -> None:
    """Validate a section's CUDA graph fields."""
    if not isinstance(enabled, bool):
        raise ValueError(f"{section_name}.cuda_graphs={enabled!r}: must be true or false")
    if enabled and not all(d.startswith("cuda") for d in devices):
        raise ValueError(f"{section_name}.cuda_graphs is true but its devices are {list(devices)}: graphs need CUDA")
    if why := bucket_sizes_error(buckets):
        raise ValueError(f"{section_name}.prompt_buckets={list(buckets)}: {why}")


def bucket_sizes_error(sizes: tuple[int, ...]) -> str:
    """Why `sizes` cannot be prompt-length buckets ("" when they can): at least one, positive ints, increasing."""
    if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
        return "must be a non-empty tuple of positive ints"
    if list(sizes) != sorted(set(sizes)):
        return "must be strictly increasing"
    return ""


def _check_budget(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e6:
        raise ValueError(f"{name}={value!r}: must be a number of GiB >= 0 (0: no share declared)")


def _check_dtype(name: str, value: str) -> None:
    if value not in DTYPES:
        raise ValueError(f"{name}={value!r}: use one of {DTYPES}")


def section(cls, raw: dict[str, Any] | None, name: str):
    """Build the dataclass `cls` from one profile section, naming any unknown key."""
    raw = dict(raw or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"profile section {name!r}: unknown keys {unknown}; known keys are {sorted(known)}")
    return cls(**raw)


def load_profile(path: str | pathlib.Path, overrides: dict[str, dict[str, Any]] | None = None) -> Profile:
    """Read one profile YAML (plus per-section overrides from flags) into a validated Profile."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"profile {path} does not exist")
    raw = yaml.safe_load(path.read_text()) or {}
    for name, values in (overrides or {}).items():
        raw.setdefault(name, {}).update(values)
    unknown = sorted(set(raw) - {"profile", "model", "endpoints", "encoder", "dit", "vae", "gateway"})
    if unknown:
        raise ValueError(f"profile {path}: unknown sections {unknown}")
    model = section(ModelConfig, raw.get("model"), "model")
    if not pathlib.Path(model.dir).is_absolute():
        model = dataclasses.replace(model, dir=str((path.parent.parent / model.dir).resolve()))
    return Profile(
        name=raw.get("profile", path.stem),
        model=model,
        endpoints=section(Endpoints, raw.get("endpoints"), "endpoints"),
        encoder=section(EncoderConfig, raw.get("encoder"), "encoder"),
        dit=section(DiTConfig, raw.get("dit"), "dit"),
        vae=section(VAEConfig, raw.get("vae"), "vae"),
        gateway=section(GatewayConfig, raw.get("gateway"), "gateway"),
        path=str(path.resolve()),
    )

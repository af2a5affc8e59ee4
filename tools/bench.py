"""Session benchmark on one GPU group: `python -m tools.bench --profile configs/usp2_fp8.yaml --requests 4`.

Runs the whole generation path with random weights built on the devices (no files), pipelined as the stage
services run it: text encoder and DiT streaming runtime (LoRA student, audio teacher, clean commit; one rank here,
the others in the DiT group's processes) in this process; the VAE service's per-stream decode and fMP4 mux
(`DecodeSession`) in a separate VAE process on the last device (`tools.bench_vae`), fed through a queue with
the DiT at most `dit.max_phases_ahead` phases ahead of delivered chunks (the services' credit window). So the VAE
shares its GPU with a DiT rank exactly as in the usp2 profile, and the real-time factor is measured, not added up. A new
prompt every request; the latents' host-bytes transport encoded and decoded as between processes. Prints
per-request stage times, the interval between delivered chunks and its real-time factor, time to first chunk
(cold and warm), GPU memory after every request, start-up time, the FLOP count and floor of each request, and
(with --baseline) the same DiT phase forward through diffusers' `MiniMaxH3Transformer3DModel` beside ours.
`--profile` takes the devices, canvas and every serving option from a deployment profile (what it serves is what is
measured); without it the flags set them one by one. Knows nothing about gRPC or websockets.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import logging
import statistics
import time

import torch

from peft.tuners.lora import LoraLayer

from tools.bench_vae import NoVAE, VAEStage
from services.common.config import (ATTENTION_KERNELS, DiTConfig, EncoderConfig, GatewayConfig, ModelConfig, Profile,
                                    VAEConfig, load_profile)
from services.tensors.cuda_graphs import PromptBuckets
from services.common.gpu_budget import budgets
from services.common.media import VIDEO_FPS
from services.tensors.transport import TensorAssembler, tensor_to_parts
from services.dit.api import PromptUpdate, SessionConfig
from services.dit.stream.geometry import TEACHER_TAIL_LATENTS, plan_request
from services.dit.group.launch import launch_group
from services.dit.group.orchestration import DiTGroup
from services.dit.model.lora import ADAPTER_NAME
from services.dit.model.network import PRESETS, DiT, FullAttention, ModelArgs
from tools.dit.probe import group_forward_seconds, phase_inputs, time_call, time_forward
from services.dit.stream.schedule import AUDIO_SIGMAS, VIDEO_SIGMAS, model_t
from services.dit.service import build_runtime
from services.dit.stream.teacher import STEPS as TEACHER_STEPS
from services.encoder.model import TextEncoder
from tools.gpu_trace import KernelTrace

log = logging.getLogger("tools.bench")

BF16_TFLOPS = 788.0
"""Dense BF16 matrix rate measured on this workplace's H200 (8192³ on random data)."""
FP8_TFLOPS = 2 * BF16_TFLOPS
"""Hopper's dense FP8 rate is twice its BF16 rate."""
PHASES_PER_REQUEST = len(plan_request(0).phases)
"""Phases of every request (the first request's geometry differs, not its phase count)."""


@dataclasses.dataclass
class FlopCounter:
    """Analytic FLOPs of every DiT forward, counted from its layout and attention pattern (real rows only)."""

    args: ModelArgs
    lora_rank: int
    linear: float = 0.0
    attention: float = 0.0

    def per_row_linear(self) -> float:
        a = self.args
        weights = a.hidden_size * 3 * a.inner_dim + a.inner_dim * a.hidden_size \
            + a.hidden_size * 2 * a.ffn_hidden + a.ffn_hidden * a.hidden_size
        lora = self.lora_rank * (a.hidden_size + 3 * a.inner_dim + a.inner_dim + a.hidden_size
                                 + a.hidden_size + 2 * a.ffn_hidden + a.ffn_hidden + a.hidden_size)
        return 2.0 * (weights + lora)

    def hook(self, module: DiT, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook: count an eagerly run forward (a replayed CUDA graph calls no hook)."""
        layout = kwargs.get("layout", args[3] if len(args) > 3 else None)
        attention = kwargs.get("attention", args[4] if len(args) > 4 else None)
        full = isinstance(attention, FullAttention)
        if layout.text_valid is not None and full:
            return  # a bucket-padded teacher step: `add_teacher` counts its real rows
        text = getattr(attention, "text_real", layout.text_len)  # a student's text padded to a bucket: its real rows
        cache = getattr(attention, "cache", None)
        self.add(text, layout.num_real - (layout.text_len - text), cache.live if cache is not None else 0, full,
                 getattr(attention, "text_keys", text))

    def add(self, tt: int, real: int, history: int, full: bool, text_keys: int | None = None) -> None:
        """Count one forward of `real` rows, `tt` of them text, over `history` cached rows; the media rows attend
        to `text_keys` text rows (default `tt`; more when the text's K/V were recorded by an earlier forward)."""
        a, media = self.args, real - tt
        keys = tt if text_keys is None else text_keys
        pairs = real * real if full else tt * tt + media * (keys + history + media)
        self.linear += self.per_row_linear() * (a.num_layers * real + a.refiner_layers * tt)
        self.attention += 4.0 * a.head_dim * a.num_heads * (a.num_layers * pairs + a.refiner_layers * tt * tt)

    def add_teacher(self, prompt_tokens: int, request_index: int) -> None:
        """Count the 9 teacher steps of a request whose forwards replayed CUDA graphs (real rows only)."""
        n_tail = 0 if request_index == 0 else TEACHER_TAIL_LATENTS
        real = prompt_tokens + 2 * (n_tail + plan_request(request_index).num_audio_latents)
        for _ in range(TEACHER_STEPS):
            self.add(prompt_tokens, real, 0, True)

    def take(self) -> tuple[float, float]:
        out = (self.linear, self.attention)
        self.linear = self.attention = 0.0
        return out


def floor_seconds(linear: float, attention: float, gpus: int, fp8: bool) -> float:
    """Time at the measured matrix rates if every FLOP ran at peak on `gpus` GPUs."""
    linear_rate = (FP8_TFLOPS if fp8 else BF16_TFLOPS) * 1e12
    return (linear / linear_rate + attention / (BF16_TFLOPS * 1e12)) / gpus


def lora_rank(model: torch.nn.Module) -> int:
    """Rank of the LoRA installed on the model (0 without one)."""
    layer = next((m for m in model.modules() if isinstance(m, LoraLayer)), None)
    return layer.r[ADAPTER_NAME] if layer is not None else 0


def prompt_text(k: int, approx_tokens: int) -> str:
    """A distinct prompt per request; random-weight encoders tokenise bytes, so length ≈ tokens."""
    words = ["neon", "rain", "city", "night", "a", "fox", "runs", "across", "the", "frozen", "river", "while",
             "drums", "play", "softly", "and", "a", "choir", "sings", "over", "wind"]
    text, i = f"request {k}:", k
    while len(text) < approx_tokens:
        text += " " + words[i % len(words)]
        i += 7
    return text[:approx_tokens]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def transport(t: torch.Tensor, name: str) -> torch.Tensor:
    """Encode a tensor to host-byte parts and decode it back, as between two stage processes."""
    asm = TensorAssembler(name)
    out = None
    for part in tensor_to_parts(t):
        out = asm.add(part)
    return out


def build(opts):
    """Build the encoder here and the DiT runtime (one rank, or a Ulysses group) with the profile's options."""
    started = time.perf_counter()
    devices = tuple(opts.devices.split(","))
    cuda = devices[0].startswith("cuda")
    profile = Profile(
        name="bench", model=ModelConfig(preset=opts.preset, dir="", random_weights_on_device=True),
        encoder=EncoderConfig(max_tokens=opts.max_tokens),
        dit=DiTConfig(devices=devices, dtype="bfloat16" if cuda else "float32",
                      canvas_short_edges=(min(opts.width, opts.height),), fp8=opts.fp8, adaln_cache=opts.adaln_cache,
                      merge_lora=opts.merge_lora, attention=opts.attention, cuda_graphs=opts.cuda_graphs,
                      teacher_sharded=opts.teacher_sharded, teacher_overlap=opts.teacher_overlap,
                      teacher_staged=opts.teacher_staged, reuse_text_kv=opts.reuse_text_kv,
                      prompt_buckets=tuple(int(n) for n in opts.prompt_buckets.split(","))),
        gateway=GatewayConfig(allowed_canvases=((opts.width, opts.height),),  # the shapes of the DiT's block graphs
                              default_canvas=(opts.width, opts.height)))
    runtime = build_runtime(profile, torch.device(devices[0])) if len(devices) == 1 \
        else launch_group(profile, build_runtime)
    encoder = TextEncoder.random(opts.preset, torch.device(devices[0]), torch.bfloat16 if cuda else torch.float32,
                                 max_tokens=opts.max_tokens)
    if opts.cuda_graphs:
        encoder.capture_graphs(PromptBuckets(profile.dit.prompt_buckets))
    sync(torch.device(devices[0]))
    return profile, encoder, runtime, time.perf_counter() - started


def gpu_memory_in_use() -> dict[str, int]:
    """Bytes in use on every visible GPU, by all processes (DiT ranks, encoder and VAE together)."""
    out = {}
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        free, total = torch.cuda.mem_get_info(i)
        out[f"cuda:{i}"] = total - free
    return out


def warmup(opts, encoder, runtime, vae: VAEStage | NoVAE) -> float:
    """One phase of a throw-away session through the DiT and the VAE, as the services do before SERVING."""
    started = time.perf_counter()
    text = encoder.encode_bytes(prompt_text(99, opts.prompt_tokens))
    session = runtime.open_session(SessionConfig(seed=1, width=opts.width, height=opts.height),
                                   PromptUpdate(text.float(), "warmup"))
    try:
        out = session.next_phase()
    finally:
        session.close()
    vae.new_session()
    vae.submit(out.video, out.audio)
    vae.drain()
    return time.perf_counter() - started


def run_session(opts, device, encoder, runtime, vae: VAEStage | NoVAE, flops: FlopCounter, max_phases: int = 0,
                trace: KernelTrace | None = None):
    """Stream opts.requests requests with a new prompt each (or only `max_phases` phases), the VAE pipelined.

    Returns per-phase records (DiT and VAE stage seconds, delivery time, GPU memory after each request) and the
    time from opening the session to the first delivered chunk. With `trace`, request `opts.trace_request` runs
    inside it.
    """
    records, t_open = [], time.monotonic()
    vae.new_session()
    first = encoder.encode_bytes(prompt_text(0, opts.prompt_tokens))
    sync(device)  # the encoder's kernels, not only their launch
    encode_s = time.monotonic() - t_open
    session = runtime.open_session(SessionConfig(seed=8301, width=opts.width, height=opts.height),
                                   PromptUpdate(first.float(), "p0"))
    open_s = time.monotonic() - t_open - encode_s
    phases = [(k, p) for k in range(opts.requests) for p in range(PHASES_PER_REQUEST)][:max_phases or None]
    prompt_tokens = {0: first.shape[0]}
    first_logged = False
    try:
        for k, p in phases:
            rec = {"request": k, "phase": p, "encode": encode_s if not records else 0.0,
                   "open": open_s if not records else 0.0}
            if p == 1 and k + 1 < opts.requests:  # the next request's prompt arrives mid-request
                text = encoder.encode_bytes(prompt_text(k + 1, opts.prompt_tokens))
                prompt_tokens[k + 1] = text.shape[0]
                session.submit_prompt(PromptUpdate(text.float(), f"p{k + 1}"))
            traced = trace is not None and k == opts.trace_request
            if traced and p == 0:
                trace.start()
            t0 = time.perf_counter()
            out = session.next_phase()
            sync(device)
            t1 = time.perf_counter()
            if traced and p == PHASES_PER_REQUEST - 1:
                trace.stop()
            if p == 0 and (opts.cuda_graphs or opts.teacher_staged):  # the hook sees no graph and no stage
                flops.add_teacher(prompt_tokens[k], k)
            rec.update(dit=t1 - t0, teacher=out.meta.timings.teacher_s, student=out.meta.timings.student_s,
                       commit=out.meta.timings.commit_s, frames=out.meta.num_frames)
            rec["linear_flops"], rec["attn_flops"] = flops.take()
            video, audio = transport(out.video, "video"), transport(out.audio, "audio")
            rec["transport"] = time.perf_counter() - t1
            vae.submit(video, audio)
            records.append(rec)
            if not first_logged and vae.results:  # logged as soon as known, so a cut-off run keeps it
                log.info("time to first chunk %.3f s", vae.results[0]["first_chunk"]["delivered"] - t_open)
                first_logged = True
            if p == PHASES_PER_REQUEST - 1:  # the request is complete: logged now, so a cut-off run keeps it
                rec["memory"] = gpu_memory_in_use()
                done = records[-PHASES_PER_REQUEST:]
                log.info("request %d: dit %.3f s (teacher %.3f, students %.3f, commit %.3f), GiB in use per GPU %s",
                         k, *(sum(r[s] for r in done) for s in ("dit", "teacher", "student", "commit")),
                         [round(b / 2**30, 1) for b in rec["memory"].values()])
    finally:
        if trace is not None and trace.running:  # a phase of the traced request raised
            trace.stop()
        session.close()
    for rec, result in zip(records, vae.drain()):
        rec.update(result)
    if not first_logged:  # a session too short for its first chunk to come back while it ran
        log.info("time to first chunk %.3f s", records[0]["first_chunk"]["delivered"] - t_open)
    return records, records[0]["first_chunk"]["delivered"] - t_open


def first_chunk_parts(first: dict, ttfc: float, teacher_beside: bool) -> str:
    """Where a session's first chunk went: its record's stage seconds in order, the rest as waiting (a teacher
    replayed beside the students overlaps them inside the DiT's share)."""
    parts = {s: first[s] for s in ("encode", "open", "dit", "transport", "hand_over")}
    parts.update((s, first["first_chunk"][s]) for s in ("video_decode", "mux"))  # the first clip's, on its own
    parts["waiting"] = ttfc - sum(parts.values())  # the DiT's phase call to its timer, the clock's resolution
    beside = " beside the students" if teacher_beside else ""
    inside = (f"teacher {first['teacher']:.3f}{beside}, students {first['student']:.3f}, "
              f"commit {first['commit']:.3f}")
    shown = " + ".join(f"{name} {sec:.3f}" + (f" ({inside})" if name == "dit" else "")
                       for name, sec in parts.items())
    return f"{shown} = {ttfc:.3f} s"


def summarize(opts, records, ttfc, warm_ttfc, startup, gpus: int, warm_first: dict,
              shares: dict[str, dict[str, float]] | None) -> str:
    lines = [f"canvas {opts.width}x{opts.height}, {opts.requests} requests, fp8={opts.fp8}, "
             f"adaln_cache={opts.adaln_cache}, merge_lora={opts.merge_lora}, cuda_graphs={opts.cuda_graphs}, "
             f"teacher_sharded={opts.teacher_sharded}, teacher_overlap={opts.teacher_overlap}, "
             f"teacher_staged={opts.teacher_staged}, "
             f"reuse_text_kv={opts.reuse_text_kv}, "
             f"attention={opts.attention}, "
             f"GPUs={gpus}; " + (
                 "no VAE (--no-vae): delivered when the DiT hands a phase over" if opts.no_vae else
                 f"VAE + mux in their own process on {opts.devices.split(',')[-1]} (tiles overlap >= "
                 f"{opts.tile_overlap} px, tiles shared with {opts.vae_tile_devices or 'no other device'}, "
                 f"ViT blocks compiled: {opts.vae_compile}, audio decoder graphs: {opts.vae_graphs}), "
                 f"pipelined with a window of {opts.window} phases"),
             f"start-up (build on device + warm-up phase): {startup:.1f} s",
             f"time to first chunk, includes the first prompt's encode and the teacher: {ttfc:.3f} s (first session "
             f"after start-up), {warm_ttfc:.3f} s (warm: a second session)",
             f"first chunk, cold: {first_chunk_parts(records[0], ttfc, opts.teacher_overlap)}",
             f"first chunk, warm: {first_chunk_parts(warm_first, warm_ttfc, opts.teacher_overlap)}",
             "(open: the session's opening; hand_over: from the DiT's put to the VAE process's decode, latents on "
             "its GPU; video_decode: the decode of the first chunk's frames (the first phase's first clip); mux: "
             "their H.264, the wait for the audio thread (decode and AAC), the fragment; waiting: the rest)",
             "delivered = time between the last chunk of the request before and this request's last chunk; "
             "RTF = delivered / media seconds", "",
             "req |   DiT s | teacher | student | commit | transport | vdecode | adecode |  mux | delivered s | RTF "
             "| PFLOP | floor s | DiT/floor | GiB in use per GPU"]
    stages = ("dit", "teacher", "student", "commit", "transport", "video_decode", "audio_decode", "mux")
    previous = records[0]["first_chunk"]["delivered"] - ttfc  # the session's start
    for k in range(opts.requests):
        rs = [r for r in records if r["request"] == k]
        tot = {s: sum(r[s] for r in rs) for s in stages}
        media = sum(r["frames"] for r in rs) / VIDEO_FPS
        delivered = rs[-1]["delivered"] - previous
        previous = rs[-1]["delivered"]
        lin, att = sum(r["linear_flops"] for r in rs), sum(r["attn_flops"] for r in rs)
        floor = floor_seconds(lin, att, gpus, opts.fp8)
        memory = " / ".join(f"{b / 2**30:.1f}" for b in rs[-1].get("memory", {}).values()) or "-"
        lines.append(f"{k:3d} | {tot['dit']:7.3f} | {tot['teacher']:7.3f} | {tot['student']:7.3f} | "
                     f"{tot['commit']:6.3f} | {tot['transport']:9.3f} | {tot['video_decode']:7.3f} | "
                     f"{tot['audio_decode']:7.3f} | {tot['mux']:4.3f} | {delivered:11.3f} | {delivered / media:.2f} | "
                     f"{(lin + att) / 1e15:5.2f} | {floor:7.3f} | {tot['dit'] / floor:9.2f} | {memory}")
    # Steady state: requests 1.., up to a traced request (collecting its kernels stalls the session for seconds).
    last = opts.requests - 1 if opts.trace_request < 0 else opts.trace_request - 1
    if last >= 1:
        steady = [r for r in records if 1 <= r["request"] <= last]
        media = sum(r["frames"] for r in steady) / VIDEO_FPS
        span = steady[-1]["delivered"] - records[PHASES_PER_REQUEST - 1]["delivered"]
        lines.append(f"steady state (requests 1..{last}{', before the traced one' if last < opts.requests - 1 else ''})"
                     f": {span:.2f} s for {media:.2f} s of media, RTF {span / media:.3f}")
        for p in range(PHASES_PER_REQUEST):  # where a steady request's time goes, phase by phase
            rs = [r for r in steady if r["phase"] == p]
            mean = {s: statistics.mean(r[s] for r in rs) for s in ("dit", "student", "commit", "video_decode")}
            lines.append(f"  phase {p} ({rs[0]['frames']} frames), mean: DiT {mean['dit']:.3f} s (students "
                         f"{mean['student']:.3f}, commit before them {mean['commit']:.3f}), video decode "
                         f"{mean['video_decode']:.3f} s")
    if torch.cuda.is_available():
        lines.append(f"peak GPU memory of this process: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB "
                     f"allocated, {torch.cuda.max_memory_reserved() / 2**30:.1f} GiB reserved")
    if shares is not None:  # the profile's: what "GiB in use per GPU" above should stay within
        lines.append("GPU memory the profile's stages declare (memory_gib, all stages on a GPU together): "
                     + (", ".join(f"{device} {sum(parts.values()):g} GiB" for device, parts in shares.items())
                        or "none"))
    return "\n".join(lines)


def baseline_profile(profile: Profile, device: torch.device) -> Profile:
    """The profile of the one-GPU baseline DiT: the same model settings on `device`, no teacher graphs (its forward
    runs no teacher), so none of the teacher options that need graphs or several ranks."""
    dit = dataclasses.replace(profile.dit, devices=(str(device),), cuda_graphs=False, teacher_overlap=False,
                              teacher_sharded=False, teacher_staged=False)
    return dataclasses.replace(profile, dit=dit)


def baseline(opts, device, model: DiT) -> dict:
    """One 10-latent phase forward without history (`tools.dit.probe`): diffusers' model vs ours on one GPU."""
    from diffusers import MiniMaxH3Transformer3DModel

    from services.dit.model.checkpoint import config_for

    inputs = phase_inputs(model, opts.height, opts.width)
    video, audio, text, layout = inputs
    ours = time_forward(model, inputs)
    with torch.inference_mode():
        cfg = {k: v for k, v in config_for(model.args, "diffusers").items() if not k.startswith("_")}
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # build straight on the device in BF16 (66 GB; fp32 would not fit)
        try:
            with torch.device(device):
                ref = MiniMaxH3Transformer3DModel(**cfg).eval()
            ref.to(device)  # buffers built on the CPU (rope.inv_freq)
        finally:
            torch.set_default_dtype(default)
        real = layout.num_real
        idx = torch.arange(real, device=device)
        tags = layout.tags[:real]
        ts = torch.tensor([model_t(VIDEO_SIGMAS[1]), model_t(AUDIO_SIGMAS[1])], device=device)
        slot = (tags == 2).long()
        run_ref = functools.partial(
            ref, hidden_states=video[None].bfloat16(), audio_hidden_states=audio[None].bfloat16(),
            encoder_hidden_states=text[None], timestep=ts, timestep_indices=slot, token_tags=tags.clamp(min=0),
            position_ids=layout.positions[:real], video_indices=idx[tags == 0], audio_indices=idx[tags == 2],
            text_indices=idx[tags == 1])
        theirs = time_call(run_ref, device)  # torch's SDPA in this process's order (cuDNN first on an H200)
        del ref, run_ref
    torch.cuda.empty_cache()
    return {"rows": real, "ours_s": ours, "diffusers_s": theirs}


PROFILE_OPTIONS = ("preset", "devices", "width", "height", "max_tokens", "fp8", "adaln_cache", "cuda_graphs",
                   "prompt_buckets", "attention", "merge_lora", "teacher_sharded", "teacher_overlap", "teacher_staged",
                   "reuse_text_kv",
                   "tile_overlap", "vae_tile_devices", "vae_compile", "vae_graphs", "window")
"""The bench options `--profile` takes from a deployment profile."""


def profile_options(profile: Profile) -> dict:
    """The bench options a deployment profile implies: its DiT, encoder and VAE settings and its default canvas."""
    dit, vae = profile.dit, profile.vae
    if vae.device != dit.devices[-1] or profile.encoder.device != dit.devices[0]:
        raise ValueError(f"profile {profile.name}: the bench runs the encoder on the first DiT device and the VAE on "
                         f"the last ({dit.devices[0]}, {dit.devices[-1]}); the profile puts them on "
                         f"{profile.encoder.device} and {vae.device}")
    width, height = profile.gateway.default_canvas
    return dict(preset=profile.model.preset, devices=",".join(dit.devices), width=width, height=height,
                max_tokens=profile.encoder.max_tokens, fp8=dit.fp8, adaln_cache=dit.adaln_cache,
                cuda_graphs=dit.cuda_graphs, prompt_buckets=",".join(map(str, dit.prompt_buckets)),
                attention=dit.attention, merge_lora=dit.merge_lora, teacher_sharded=dit.teacher_sharded,
                teacher_overlap=dit.teacher_overlap, teacher_staged=dit.teacher_staged,
                reuse_text_kv=dit.reuse_text_kv,
                tile_overlap=vae.tile_overlap_px, vae_tile_devices=",".join(vae.tile_devices),
                vae_compile=vae.compile_blocks, vae_graphs=vae.cuda_graphs, window=dit.max_phases_ahead)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None,
                        help="take the options below that a deployment profile sets from this YAML (for example "
                             "configs/usp2_fp8.yaml), so the bench measures what the profile serves")
    parser.add_argument("--preset", default="full", choices=sorted(PRESETS))
    parser.add_argument("--devices", default="cuda:0",
                        help="comma-separated DiT devices, one per Ulysses rank; encoder on the first, VAE on the last")
    parser.add_argument("--width", type=int, default=864)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=380)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--adaln-cache", action="store_true")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="capture the text encoder and the audio teacher's steps as CUDA graphs (*.cuda_graphs)")
    parser.add_argument("--prompt-buckets", default=",".join(map(str, DiTConfig().prompt_buckets)),
                        help="prompt lengths the graphs are captured for (the largest must hold --max-tokens)")
    parser.add_argument("--baseline", action="store_true", help="also time diffusers' forward (CUDA only)")
    parser.add_argument("--attention", default="default", choices=ATTENTION_KERNELS,
                        help="attention kernels of every DiT rank (dit.attention)")
    parser.add_argument("--merge-lora", action="store_true",
                        help="fold the LoRA into the base weights; the teacher subtracts it (dit.merge_lora)")
    parser.add_argument("--teacher-sharded", action="store_true",
                        help="graphed teacher steps sharded over the DiT group (dit.teacher_sharded)")
    parser.add_argument("--teacher-overlap", action="store_true",
                        help="graphed teacher steps replayed beside the commit and the first student step "
                             "(dit.teacher_overlap)")
    parser.add_argument("--teacher-staged", action="store_true",
                        help="the teacher's blocks split into one stage per DiT rank (dit.teacher_staged)")
    parser.add_argument("--no-reuse-text-kv", dest="reuse_text_kv", action="store_false",
                        help="run the text rows in every forward instead of once per request and timestep "
                             "(dit.reuse_text_kv: false)")
    parser.add_argument("--tile-overlap", type=int, default=VAEConfig().tile_overlap_px,
                        help="minimum overlap of the video decode tiles in px (vae.tile_overlap_px)")
    parser.add_argument("--vae-tile-devices", default="",
                        help="comma-separated further devices that decode a share of the video tiles "
                             "(vae.tile_devices)")
    parser.add_argument("--vae-compile", action="store_true",
                        help="torch.compile the video decoder's ViT blocks, warmed up before the session "
                             "(vae.compile_blocks)")
    parser.add_argument("--vae-graphs", action="store_true",
                        help="capture the audio decoder per phase size as CUDA graphs (vae.cuda_graphs)")
    parser.add_argument("--no-vae", action="store_true",
                        help="no decode or mux: a chunk counts as delivered when the DiT hands it over")
    parser.add_argument("--trace-request", type=int, default=-1,
                        help="profile this request's GPU kernels on the DiT's rank 0 and print how busy its GPU was "
                             "and with which kernels (attention, GEMM, NCCL, other)")
    parser.add_argument("--window", type=int, default=DiTConfig().max_phases_ahead,
                        help="phases the DiT may run ahead of delivered chunks (the services' dit.max_phases_ahead)")
    opts = parser.parse_args()
    if opts.profile is not None:
        given = [f"--{name.replace('_', '-')}" for name in PROFILE_OPTIONS
                 if getattr(opts, name) != parser.get_default(name)]
        if given:
            parser.error(f"--profile sets {', '.join(given)} itself; drop them or leave out --profile")
        try:
            served = load_profile(opts.profile)
            vars(opts).update(profile_options(served))
        except ValueError as e:
            parser.error(str(e))
        shares = budgets(served)
    else:
        shares = None
    if not -1 <= opts.trace_request < opts.requests:
        parser.error(f"--trace-request {opts.trace_request}: the session has requests 0..{opts.requests - 1}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = torch.device(opts.devices.split(",")[0])
    torch.manual_seed(0)
    vae = NoVAE() if opts.no_vae else VAEStage(opts, opts.window)  # first: spawn before any CUDA context
    try:
        with torch.inference_mode():
            profile, encoder, runtime, startup = build(opts)
            startup += warmup(opts, encoder, runtime, vae)
            flops = FlopCounter(runtime.model.args, lora_rank(runtime.model))
            runtime.model.register_forward_pre_hook(flops.hook, with_kwargs=True)
            trace = KernelTrace() if opts.trace_request >= 0 else None
            records, ttfc = run_session(opts, device, encoder, runtime, vae, flops, trace=trace)
            warm, warm_ttfc = run_session(opts, device, encoder, runtime, vae, flops, max_phases=1)
    finally:
        vae.stop()
    del encoder
    group_forward_s = None
    if isinstance(runtime, DiTGroup):
        if opts.baseline:  # the profile's own forward of the baseline's phase: every rank of the group
            group_forward_s = group_forward_seconds(runtime, opts.height, opts.width)
        runtime.shutdown()
    gpus = profile.dit.usp_degree
    del runtime
    gc.collect()
    print(summarize(opts, records, ttfc, warm_ttfc, startup, gpus=gpus, warm_first=warm[0], shares=shares),
          flush=True)
    if trace is not None:
        print("\n".join([f"request {opts.trace_request} traced (this process's GPU kernels: DiT rank 0 and its "
                          "teacher worker; other ranks and the VAE process are not seen):", *trace.summary()]),
              flush=True)
    base = None
    if opts.baseline:  # one GPU, a fresh DiT built like the profile's (FP8, AdaLN cache, LoRA)
        torch.cuda.empty_cache()
        single = baseline_profile(profile, device)
        with torch.inference_mode():
            base = baseline(opts, device, build_runtime(single, device).model)
    if base is not None:
        print(f"phase forward, {base['rows']} rows, no history, one GPU: ours {base['ours_s'] * 1e3:.0f} ms, "
              f"diffusers MiniMaxH3Transformer3DModel {base['diffusers_s'] * 1e3:.0f} ms "
              f"(x{base['diffusers_s'] / base['ours_s']:.2f})", flush=True)
        if group_forward_s is not None:
            print(f"the same phase forward by the {gpus}-GPU group: {group_forward_s * 1e3:.0f} ms "
                  f"(x{base['diffusers_s'] / group_forward_s:.2f} against diffusers on one GPU)", flush=True)


if __name__ == "__main__":
    main()

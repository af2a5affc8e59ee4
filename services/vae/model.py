"""MiniMax-H3 video and audio VAE decoders: presets and latent -> media wrappers around `diffusers`.

Knows nothing about streaming state, muxing or gRPC. The networks are the `diffusers` classes
`AutoencoderKLMiniMaxH3` (causal CNN encoder, non-causal ViT decoder over 17-frame clips; 16x spatial, 4x temporal,
24 latent channels) and `AutoencoderKLMiniMaxH3Audio` (BigVGAN decoder, 40 Hz latents -> 32 kHz mono, each stereo
channel decoded as one batch row). This file adds the named presets, the per-channel latent denormalisation
(`z * std + mean`, from each model's config), the pixel post-processing (ImageNet de-normalisation, clamp, uint8) and
input validation.

Video decoding does not call `AutoencoderKLMiniMaxH3.decode`, which runs the ViT once per spatial tile per 17-frame
clip (15 tiles x 2 clips = 30 sequential calls per 480x864 phase). `VideoDecoder` lays out the same clips (7 latents
every 5) and the same spatial tile grid (`vae._split_tiles` with the model's tile size and overlap, 256 px / 64 px
minimum in the release), cuts every tile of every clip from the latents, runs them through `post_quant_conv` and the
ViT as one batch (each batch row is one tile of one clip, so every tile sees exactly the pixels it sees in diffusers),
then blends tiles and clips with the library's own `_stitch_tiles` / `_blend`, vectorised over clips. The result
equals the diffusers decode up to GEMM reassociation across batch sizes (see tools/vae/bench_decode.py). With
tile replicas (copies of the network on other GPUs) each device decodes an equal share of those rows concurrently,
so the decode's GPU time is spread over the GPUs the DiT ranks share with it.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import ContextManager, Iterator, Sequence

import torch
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
from diffusers.models.modeling_utils import get_parameter_dtype

from services.common.errors import InvalidInput
from services.common.startup import Steps
from services.tensors.cuda_graphs import CudaGraphBank, GraphKey

log = logging.getLogger(__name__)

VIDEO_LATENT_CHANNELS = 24
AUDIO_LATENT_CHANNELS = 32
AUDIO_CHANNELS = 2
# The video decoder emits ImageNet-normalised RGB over a [0, 1] base range.
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)

# Per-channel latent statistics of the released checkpoints (vae/config.json, audio_vae/config.json).
_VIDEO_LATENTS_MEAN = (
    0.85809034, -0.96065915, 1.06616402, -0.50903255, -0.27275819, -1.36754143, -0.2553255, -0.26907554,
    -0.53768408, -0.04640973, 0.66573703, 0.19690128, -0.5460608, -0.4035342, -0.23683025, 0.25928453,
    -0.30133945, 0.21134199, -1.12068486, 0.35819334, -0.04225144, 0.260483, 0.22864093, 0.70560318)
_VIDEO_LATENTS_STD = (
    1.22237742, 1.27672637, 1.68317747, 1.75494552, 1.56362164, 2.19414353, 0.96531379, 1.0569886,
    0.84194893, 0.77299529, 1.89559376, 0.94684184, 0.79968095, 0.449889, 0.71973997, 0.69362932,
    2.96109509, 2.76941991, 3.04961848, 2.10880542, 3.27622628, 3.1627357, 2.2816813, 2.61278439)
_AUDIO_LATENTS_MEAN = (
    -0.02021169, 0.38764665, -0.0439828, -0.28591515, 0.08179686, -0.35782641, 0.04062381, -0.01552535,
    -0.22336248, 0.18210068, 0.29417788, -0.07901168, -0.05681507, -0.36990282, -0.31616316, 0.59059514,
    -0.05213957, 0.01367316, -0.03691648, 0.09732661, -0.33946623, -0.30685678, -0.24504599, -0.03469852,
    0.02868032, -0.21217779, -0.16782632, 0.32212879, -0.12230559, 0.43566049, -0.05025992, 0.39792584)
_AUDIO_LATENTS_STD = (
    1.68955242, 2.76263727, 1.79453443, 1.68016818, 1.63902265, 2.77882983, 1.76590901, 1.61997576,
    2.63365256, 1.85393567, 2.50564979, 1.81101924, 1.95796578, 1.66854982, 1.49224693, 3.2986702,
    1.94918045, 1.87200033, 1.83340801, 1.64880704, 1.61769577, 1.91314492, 1.56952454, 1.69436599,
    1.83184208, 1.55406374, 1.93449303, 1.59919822, 1.71804599, 1.63072192, 1.86612261, 1.56137682)

# Constructor kwargs of AutoencoderKLMiniMaxH3. `full` is the released vae/config.json; `tiny` keeps the
# geometry (16x spatial, 4x temporal, 17-frame clips, 24 channels) and shrinks every width and depth.
VIDEO_PRESETS: dict[str, dict] = {
    "full": dict(
        in_channels=3, out_channels=3, latent_channels=24, block_out_channels=(128, 256, 256, 512, 512, 1024),
        layers_per_block=2, spatial_downsample_factors=(2, 2, 2, 2, 1, 1),
        temporal_downsample_factors=(1, 2, 2, 1, 1, 1), norm_num_groups=32, norm_eps=1e-6,
        spatial_padding_mode="reflect", decoder_num_layers=36, decoder_num_attention_heads=32,
        decoder_attention_head_dim=64, decoder_num_register_tokens=4, decoder_ffn_mult=4,
        decoder_rope_theta=100.0, decoder_rope_dim_ratio=0.75, decoder_norm_eps=1e-5, clip_length=17,
        token_drop=3, latents_mean=_VIDEO_LATENTS_MEAN, latents_std=_VIDEO_LATENTS_STD),
    "tiny": dict(
        in_channels=3, out_channels=3, latent_channels=24, block_out_channels=(8, 8, 16, 16, 16, 16),
        layers_per_block=1, spatial_downsample_factors=(2, 2, 2, 2, 1, 1),
        temporal_downsample_factors=(1, 2, 2, 1, 1, 1), norm_num_groups=4, norm_eps=1e-6,
        spatial_padding_mode="reflect", decoder_num_layers=2, decoder_num_attention_heads=2,
        decoder_attention_head_dim=16, decoder_num_register_tokens=4, decoder_ffn_mult=2,
        decoder_rope_theta=100.0, decoder_rope_dim_ratio=0.75, decoder_norm_eps=1e-5, clip_length=17,
        token_drop=3, latents_mean=_VIDEO_LATENTS_MEAN, latents_std=_VIDEO_LATENTS_STD),
}
# Constructor kwargs of AutoencoderKLMiniMaxH3Audio; `tiny` keeps the 800x hop (40 Hz -> 32 kHz) and 32 channels.
AUDIO_PRESETS: dict[str, dict] = {
    "full": dict(
        encoder_dim=64, encoder_rates=(2, 4, 4, 5, 5), latent_dim=2048, latent_channels=32, decoder_dim=1024,
        decoder_rates=(5, 5, 2, 2, 2, 2, 2), decoder_kernel_sizes=(9, 9, 4, 4, 4, 4, 4), num_attention_heads=8,
        resblock_kernel_sizes=(3, 7, 11), resblock_dilation_sizes=((1, 3, 5), (1, 3, 5), (1, 3, 5)),
        sampling_rate=32000, latents_mean=list(_AUDIO_LATENTS_MEAN), latents_std=list(_AUDIO_LATENTS_STD)),
    "tiny": dict(
        encoder_dim=4, encoder_rates=(2, 4, 4, 5, 5), latent_dim=64, latent_channels=32, decoder_dim=128,
        decoder_rates=(5, 5, 2, 2, 2, 2, 2), decoder_kernel_sizes=(9, 9, 4, 4, 4, 4, 4), num_attention_heads=2,
        resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1, 3),),
        sampling_rate=32000, latents_mean=list(_AUDIO_LATENTS_MEAN), latents_std=list(_AUDIO_LATENTS_STD)),
}


class InvalidLatents(InvalidInput):
    """Latents handed to a decoder have the wrong rank, channel count, length or values."""


def _preset(table: dict[str, dict], name: str, what: str) -> dict:
    if name not in table:
        raise ValueError(f"unknown {what} preset {name!r}; known presets: {sorted(table)}")
    return dict(table[name])


def build_video_vae(preset: str) -> AutoencoderKLMiniMaxH3:
    """Construct the video VAE of `preset` with the library's default initialisation (CPU, float32)."""
    return AutoencoderKLMiniMaxH3(**_preset(VIDEO_PRESETS, preset, "video VAE"))


def build_audio_vae(preset: str) -> AutoencoderKLMiniMaxH3Audio:
    """Construct the audio VAE of `preset` with the library's default initialisation (CPU, float32)."""
    return AutoencoderKLMiniMaxH3Audio(**_preset(AUDIO_PRESETS, preset, "audio VAE"))


@dataclass
class TemporalCarry:
    """A stream's held-back video frames between two decodes of consecutive latents."""

    overlap: torch.Tensor | None = None
    """Model-space `[3, 5, H, W]`: the overlap frames of the last clip decoded so far. A whole decode cross-fades
    them with the next clip's first 5 frames, so they are final only once that clip is decoded (None at first)."""


class VideoDecoder:
    """Normalised video latents `[F, 24, h, w]` -> RGB frames; every tile of every clip in one batched ViT call."""

    def __init__(self, vae: AutoencoderKLMiniMaxH3, max_batch: int = 64, tile_overlap: int | None = None,
                 tile_replicas: Sequence[AutoencoderKLMiniMaxH3] = (), compile_blocks: bool = False) -> None:
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch (tiles per ViT call) must be a positive int, got {max_batch!r}")
        if tile_overlap is not None:  # the minimum overlap of neighbouring tiles, in pixels (release: 64)
            ratio, tile = vae.spatial_compression_ratio, min(vae.tile_sample_min_height, vae.tile_sample_min_width)
            if not isinstance(tile_overlap, int) or tile_overlap < ratio or tile_overlap % ratio or tile_overlap >= tile:
                raise ValueError(f"tile_overlap={tile_overlap!r}: must be a multiple of {ratio} px (tile edges stay "
                                 f"on latents) from {ratio} to below the {tile} px tile")
            vae.enable_tiling(tile_sample_min_overlap_height=tile_overlap, tile_sample_min_overlap_width=tile_overlap)
        self.vae = vae.eval()
        self.max_batch = max_batch
        """Most (clip, tile) pairs per ViT call; a 480x864 phase (2 clips x 15 tiles) is one call."""
        param = next(vae.parameters())
        self.device = param.device
        for replica in tile_replicas:
            if replica.config != vae.config:
                raise ValueError("a tile replica of the video VAE must have the primary's config")
        self.replicas = [replica.eval() for replica in tile_replicas]
        """Copies of the network on other devices: each decodes an equal share of every phase's tiles, at once."""
        if compile_blocks:  # each ViT block compiled for the shapes it meets (see `warm_up_video`)
            for net in (self.vae, *self.replicas):
                net.compile_repeated_blocks()
        self._pool = ThreadPoolExecutor(len(self.replicas), "vae-tiles") if self.replicas else None
        stats = dict(device=self.device, dtype=torch.float32)
        # mean/std: [1, C, 1, 1, 1] for the [B, C, F, h, w] diffusers layout.
        self._mean = torch.tensor(vae.config.latents_mean, **stats).view(1, -1, 1, 1, 1)
        self._std = torch.tensor(vae.config.latents_std, **stats).view(1, -1, 1, 1, 1)
        self._rgb_mean = torch.tensor(_IMAGENET_MEAN, **stats).view(1, 1, 1, 3)
        self._rgb_std = torch.tensor(_IMAGENET_STD, **stats).view(1, 1, 1, 3)

    @property
    def spatial_ratio(self) -> int:
        return self.vae.spatial_compression_ratio

    @property
    def temporal_ratio(self) -> int:
        return self.vae.temporal_compression_ratio

    def num_frames(self, num_latents: int) -> int:
        """Return how many pixel frames a whole-clip decode of `num_latents` latents yields."""
        clip, overlap = self.vae.tokens_chunk_size, self.vae.token_overlap
        groups, rest = divmod(num_latents - overlap, clip)
        if rest or groups < 1:
            raise InvalidLatents(
                f"video decode needs {overlap} + {clip}k latent frames (k >= 1), got {num_latents}")
        return groups * self.vae.config.clip_length + self.vae.frame_overlap

    def validate(self, latents: torch.Tensor) -> None:
        """Raise InvalidLatents unless `latents` is a finite `[F, 24, h, w]` tensor with a decodable F."""
        channels = self.vae.config.latent_channels
        if not isinstance(latents, torch.Tensor) or latents.ndim != 4:
            shape = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
            raise InvalidLatents(f"video latents must be [F, {channels}, h, w], got {shape}")
        if latents.shape[1] != channels:
            raise InvalidLatents(
                f"video latents must have {channels} channels on dim 1, got shape {tuple(latents.shape)}")
        if min(latents.shape[2:]) < 1:
            raise InvalidLatents(f"video latents have an empty spatial grid: {tuple(latents.shape)}")
        if not latents.is_floating_point() or not torch.isfinite(latents).all():
            raise InvalidLatents("video latents must be finite floating-point values")

    def tile_grid(self, height: int, width: int) -> tuple[list[int], int, list[int], list[int], int, list[int]]:
        """Return the pixel tile layout `(ys, tile_h, y_overlaps, xs, tile_w, x_overlaps)` of an `H x W` canvas.

        Same grid as `AutoencoderKLMiniMaxH3._decode_clip`: the model's tile size and minimum overlap when tiling is
        enabled (every tile then has the same size), one canvas-sized tile otherwise.
        """
        vae = self.vae
        if not vae.use_tiling:
            return [0], height, [], [0], width, []
        ys, heights, y_overlaps = vae._split_tiles(
            height, vae.tile_sample_min_height, vae.tile_sample_min_overlap_height)
        xs, widths, x_overlaps = vae._split_tiles(width, vae.tile_sample_min_width, vae.tile_sample_min_overlap_width)
        return ys, heights[0], y_overlaps, xs, widths[0], x_overlaps

    def _clip_videos(self, z: torch.Tensor, clips: range) -> torch.Tensor:
        """Decode clips `clips` of denormalised latents `z: [C, F, h, w]` (F = 2 + 5k) to model-space video
        `[len(clips), 3, 28, H, W]`, every tile of those clips in one batch."""
        vae, ratio = self.vae, self.spatial_ratio
        clip, overlap = vae.tokens_chunk_size, vae.token_overlap
        # stacked: [K, C, 7, h, w], clip k covers latents [5k, 5k + 7) like diffusers' `_decode`.
        stacked = torch.stack([z[:, k * clip:k * clip + clip + overlap] for k in clips])
        ys, tile_h, y_overlaps, xs, tile_w, x_overlaps = self.tile_grid(z.shape[2] * ratio, z.shape[3] * ratio)
        th, tw = tile_h // ratio, tile_w // ratio
        # tiles: [K * T, C, 7, th, tw], clip-major; tile (i, j) is row-major over the (ys, xs) grid.
        tiles = torch.stack([stacked[..., y // ratio:y // ratio + th, x // ratio:x // ratio + tw]
                             for y in ys for x in xs], dim=1).flatten(0, 1)
        decoded = self._decode_tiles(tiles)
        decoded = decoded.unflatten(0, (len(clips), len(ys) * len(xs)))  # [K, T, 3, 28, tile_h, tile_w]
        rows = [[decoded[:, i * len(xs) + j] for j in range(len(xs))] for i in range(len(ys))]
        return vae._stitch_tiles(rows, y_overlaps, x_overlaps)  # [K, 3, 28, H, W]

    def _decode_clip_parts(self, z: torch.Tensor, parts: Sequence[range],
                           carry: TemporalCarry | None = None) -> Iterator[torch.Tensor]:
        """Decode denormalised latents `z: [C, F, h, w]` (F = 2 + 5k) part by part, each part a run of consecutive
        clips decoded in one batch; yield each part's model-space frames `[3, n, H, W]` as soon as they are final.
        The parts' frames together are the whole decode's. With `carry`, its overlap frames (from the decode of the
        latents before `z`, whose last 2 latents are `z`'s first 2) are cross-faded into the first clip's head and
        yielded, and the last clip's overlap frames are held in `carry` instead of yielded."""
        vae = self.vae
        # Each clip's first 5 latents give 17 frames (after the 3 pre-padding frames), its 2 overlap latents give the
        # 5 frames that are cross-faded into the next clip's head; the last clip's overlap frames end the video. So
        # a part's frames are final once its clips are decoded, except its last clip's overlap frames, which go
        # into the next part's first head.
        chunk, pre = vae.tokens_chunk_size * self.temporal_ratio, vae.frame_pre_padding
        carried = None if carry is None else carry.overlap  # [3, 5, H, W]: the previous clip's overlap frames
        for i, clips in enumerate(parts):
            video = self._clip_videos(z, clips)
            heads = video[:, :, pre:chunk]  # [k, 3, 17, H, W]
            if vae.config.token_drop <= 0:  # no overlap latents: the clips simply follow each other
                yield heads.transpose(0, 1).flatten(1, 2)
                continue
            tails = video[:, :, chunk + pre:]  # [k, 3, 5, H, W]
            # each head after the stream's first is cross-faded with the overlap frames of the clip before it
            before = tails[:-1] if carried is None else torch.cat([carried[None], tails[:-1]])
            pieces = [heads[0]] if carried is None else []
            if before.shape[0]:
                pieces += vae._blend(before, heads[-before.shape[0]:], vae.frame_overlap, dim=-3).unbind(0)
            if i < len(parts) - 1:
                carried = tails[-1]
            elif carry is None:
                pieces.append(tails[-1])
            else:
                carry.overlap = tails[-1]
            yield torch.cat(pieces, dim=1)

    def _decode_tiles(self, tiles: torch.Tensor) -> torch.Tensor:
        """`post_quant_conv` + ViT of every tile; with replicas, contiguous shares decoded on their devices at once."""
        # tiles: [N, C, 7, th, tw] -> [N, 3, 28, tile_h, tile_w] on self.device, in tile order
        nets = [self.vae, *self.replicas]
        shares = [(net, share) for net, share in zip(nets, tiles.tensor_split(len(nets))) if share.shape[0]]
        futures = [self._pool.submit(self._decode_share, net, share) for net, share in shares[1:]]
        first = self._decode_share(*shares[0])
        rest = [future.result().to(self.device) for future in futures]
        return torch.cat([first, *rest]) if rest else first

    def _decode_share(self, net: AutoencoderKLMiniMaxH3, tiles: torch.Tensor) -> torch.Tensor:
        """Decode `tiles` on `net`'s device in groups of `max_batch` (runs in a worker thread for a replica)."""
        device = next(net.parameters()).device
        with on_device(device), torch.inference_mode():  # a worker thread does not inherit the caller's inference mode
            parts = [net.decoder(net.post_quant_conv(part)) for part in tiles.to(device).split(self.max_batch)]
            return parts[0] if len(parts) == 1 else torch.cat(parts)

    @torch.inference_mode()
    def decode_pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode normalised latents `[F, 24, h, w]` to float RGB `[N, H, W, 3]` in [0, 1]."""
        (rgb,) = self.decode_pixel_parts(latents, head_clips=0)
        return rgb

    @torch.inference_mode()
    def decode_pixel_parts(self, latents: torch.Tensor, head_clips: int,
                           carry: TemporalCarry | None = None) -> Iterator[torch.Tensor]:
        """Decode normalised latents `[F, 24, h, w]` in two parts, the first `head_clips` clips and then the rest
        (in one part when `head_clips` is 0); yield each part's float RGB frames `[n, H, W, 3]` in [0, 1] as soon
        as it is decoded. `carry`: see `_decode_clip_parts`."""
        self.validate(latents)
        self.num_frames(latents.shape[0])
        num_clips = (latents.shape[0] - self.vae.token_overlap) // self.vae.tokens_chunk_size
        if not 0 <= head_clips < num_clips:
            raise InvalidLatents(f"head_clips={head_clips}: the {latents.shape[0]} latents hold {num_clips} clips, "
                                 "and the second part needs at least one")
        parts = [range(head_clips), range(head_clips, num_clips)] if head_clips else [range(num_clips)]
        # z: [1, C, F, h, w], denormalised per channel, in the dtype of the first decoder module (like diffusers).
        z = latents.to(self.device, torch.float32).permute(1, 0, 2, 3)[None] * self._std + self._mean
        for sample in self._decode_clip_parts(z[0].to(get_parameter_dtype(self.vae.post_quant_conv)), parts, carry):
            yield self.to_rgb(sample)

    def to_rgb(self, sample: torch.Tensor) -> torch.Tensor:
        """Model-space frames `[3, n, H, W]` -> float RGB `[n, H, W, 3]` in [0, 1] (ImageNet de-normalised, clamped)."""
        rgb = sample.permute(1, 2, 3, 0).float()  # sample: [3, n, H, W] -> rgb: [n, H, W, 3]
        return (rgb * self._rgb_std + self._rgb_mean).clamp_(0.0, 1.0)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode normalised latents `[F, 24, h, w]` to uint8 frames `[N, H, W, 3]` on the CPU."""
        return to_uint8(self.decode_pixels(latents))


def on_device(device: torch.device) -> ContextManager:
    """Make `device` the current CUDA device (a worker thread starts on cuda:0); nothing for a CPU device."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def to_uint8(rgb: torch.Tensor) -> torch.Tensor:
    """Quantise float RGB in [0, 1] to uint8 on the CPU, each frame's pixels contiguous (the decoder's output is a
    channels-outermost view; the muxer would otherwise gather every frame)."""
    return (rgb * 255.0).round_().to(torch.uint8, memory_format=torch.contiguous_format).cpu()


# BT.601 limited range, as FFmpeg's swscale converts rgb24 to yuv420p for libx264 (rows: Y, Cb, Cr; R, G, B).
_BT601 = ((0.299, 0.587, 0.114), (-0.168736, -0.331264, 0.5), (0.5, -0.418688, -0.081312))


def to_i420(rgb: torch.Tensor) -> torch.Tensor:
    """Float RGB `[N, H, W, 3]` in [0, 1] -> uint8 I420 planes `[N, H * 3 / 2, W]` on the CPU.

    Y at full size, then Cb and Cr averaged over 2 x 2 pixels, each plane's bytes in order (the layout PyAV takes
    for yuv420p). Converted where the pixels are: on a GPU this is a few small kernels, and the host then copies
    half the bytes and skips swscale before libx264; on a CPU, swscale on uint8 RGB is the faster way.
    """
    n, h, w, _ = rgb.shape
    if h % 2 or w % 2:
        raise ValueError(f"frames {w}x{h}: I420 needs an even width and height")
    m = torch.tensor(_BT601, dtype=rgb.dtype, device=rgb.device)  # [3 (Y, Cb, Cr), 3 (R, G, B)]
    # weighted sums, not matmuls: no TF32 on a GPU, the same result on every device
    luma = 16.0 + 219.0 * (rgb * m[0]).sum(dim=-1)  # [N, H, W]
    pooled = rgb.reshape(n, h // 2, 2, w // 2, 2, 3).mean(dim=(2, 4))  # [N, H/2, W/2, 3]
    cb, cr = (128.0 + 224.0 * (pooled * row).sum(dim=-1) for row in m[1:])  # [N, H/2, W/2] each
    planes = torch.cat([luma.reshape(n, -1), cb.reshape(n, -1), cr.reshape(n, -1)], dim=1)
    return planes.round_().clamp_(0, 255).to(torch.uint8).reshape(n, h * 3 // 2, w).cpu()


class AudioDecoder:
    """Normalised stereo audio latents `[2, A, 32]` -> float32 waveform `[2, A * 800]` in [-1, 1]."""

    def __init__(self, vae: AutoencoderKLMiniMaxH3Audio) -> None:
        self.vae = vae.eval()
        self.device = next(vae.parameters()).device
        stats = dict(device=self.device, dtype=torch.float32)
        # mean/std: [1, C, 1] for the [B, C, A] diffusers layout.
        self._mean = torch.tensor(vae.config.latents_mean, **stats).view(1, -1, 1)
        self._std = torch.tensor(vae.config.latents_std, **stats).view(1, -1, 1)
        self.graphs: CudaGraphBank | None = None
        """The decode captured per latent length (`capture_graphs`); None decodes eagerly."""
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        """The decode's own CUDA stream (`own_stream`), so it runs beside the video decode instead of queued
        behind the video's kernels on the legacy default stream, which every thread of the process shares."""

    @contextmanager
    def own_stream(self, ready: "torch.cuda.Event | None") -> Iterator[None]:
        """Queue the block's kernels on the decoder's own stream, after `ready` (recorded by the thread that made
        the latents, on its stream); nothing on the CPU."""
        if self.stream is None:
            yield
            return
        if ready is not None:
            self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            yield

    @property
    def hop_length(self) -> int:
        return self.vae.hop_length

    @property
    def sample_rate(self) -> int:
        return self.vae.config.sampling_rate

    def validate(self, latents: torch.Tensor) -> None:
        """Raise InvalidLatents unless `latents` is a finite `[2, A, 32]` tensor with A >= 1."""
        channels = self.vae.config.latent_channels
        if not isinstance(latents, torch.Tensor) or latents.ndim != 3:
            shape = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
            raise InvalidLatents(f"audio latents must be [{AUDIO_CHANNELS}, A, {channels}], got {shape}")
        if latents.shape[0] != AUDIO_CHANNELS or latents.shape[2] != channels:
            raise InvalidLatents(f"audio latents must be [{AUDIO_CHANNELS}, A, {channels}] (stereo, A latents, "
                                 f"{channels} channels), got {tuple(latents.shape)}")
        if latents.shape[1] < 1:
            raise InvalidLatents("audio latents are empty (A = 0)")
        if not latents.is_floating_point() or not torch.isfinite(latents).all():
            raise InvalidLatents("audio latents must be finite floating-point values")

    @torch.inference_mode()
    def capture_graphs(self, lengths: Sequence[int]) -> None:
        """Capture the decode of each latent length as a CUDA graph (an incremental stream decodes a handful:
        `incremental.audio_graph_lengths`); other lengths decode eagerly. The vocoder's ~thousand small kernels
        per call are otherwise launched one by one from the VAE's audio thread."""
        bank = CudaGraphBank(self.device)
        captured = Steps(log, "audio-decoder CUDA graphs", len(lengths))
        for n in lengths:
            z = torch.zeros(AUDIO_CHANNELS, self.vae.config.latent_channels, n, device=self.device)  # [2, C, n]
            bank.capture(GraphKey.for_inputs("audio_vae", [z]), self._waveform, [z])
            captured.tick(f"{n} latents")
        bank.seal()
        self.graphs = bank

    def _waveform(self, z: torch.Tensor) -> torch.Tensor:
        # z: [2, C, A] denormalised -> wave [2, 1, A * hop]
        return self.vae.decode(z).sample

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode `[2, A, 32]` to float32 `[2, A * hop]` on the CPU; each channel is decoded as mono."""
        self.validate(latents)
        # z: [2, C, A], one stereo channel per batch row, denormalised per latent channel.
        z = latents.to(self.device, torch.float32).transpose(1, 2) * self._std + self._mean
        if self.graphs is None:
            wave = self._waveform(z)  # wave: [2, 1, A * hop]
        else:  # a replay's output buffer is the graph's own: copied out by .cpu() before the next replay
            wave = self.graphs.run(GraphKey.for_inputs("audio_vae", [z]), self._waveform, [z])
        return wave[:, 0].float().cpu()

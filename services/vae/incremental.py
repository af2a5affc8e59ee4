"""Phase-by-phase video and audio decoding with temporal context carried between calls.

Knows nothing about the DiT, gRPC or muxing: it receives each streaming phase's normalised latents and returns
that phase's frames / samples, keeping just enough context from earlier phases.

Video geometry (from `AutoencoderKLMiniMaxH3._decode`, clip_length 17, token_drop 3, 4x temporal): a decode walks
clips of `tokens_chunk_size + token_overlap` = 5 + 2 latents starting every 5 latents. The first 5 latents of a clip
give 17 frames (1 + 4 + 4 + 4 + 4; the first latent's 3 leading frames are the encoder's implicit pre-padding) and
the 2 overlap latents give `frame_overlap` = 5 frames (1 + 4) that are cross-faded with the head of the next clip.
Each clip is decoded independently (full attention inside the clip only), so a decode is clip-local.

TaoMate-H3 publishes one decode of the whole session's latents (runner.py: each request's transport prefix is cropped,
the requests are concatenated and decoded once), so every clip boundary, phase and request boundaries included, is
cross-faded. Streaming reproduces it: every call after the first prepends the previous call's last `token_overlap`
(2) latents, and the last clip's `frame_overlap` (5) overlap frames of each call are held back (model space, before
the clamp) and cross-faded into the next call's first clip head, which those 2 latents decode. The first call must
hold 2 + 5k latents (request 0 phase 0: 12 latents -> 34 frames out, 5 held), later calls 5k latents (10 -> 34,
5 -> 17); `flush_pixels()` gives the held frames at the end of a stream (the whole decode's last 5 frames). Every frame
then equals the whole decode (bit for bit when the decoder runs one tile per ViT call; within float reassociation,
about 1e-7, when the whole decode batches more clips per call than a phase does), 5 frames (208 ms) later.

Audio: the BigVGAN decoder is a stack of non-causal convolutions. Each call decodes
`[last context_latents of earlier calls | new latents | last new latent repeated pad_latents times]` and returns only
the new part. With a context at least the decoder's left receptive radius every sample matches the whole decode
except those within the right radius of the call's end, which a whole decode computes from latents that do not exist
yet. The repeated-latent padding stands in for them and keeps the decoder's own end-of-signal edge effect out of
every phase boundary: on tiny random weights the peak boundary error drops from 0.15 to 0.04 full scale with it
(RMS about 7% of the signal inside the last radius of each phase, exact elsewhere).
"""
from __future__ import annotations

from typing import Iterator

import torch

from services.vae.model import AudioDecoder, InvalidLatents, TemporalCarry, VideoDecoder, to_i420, to_uint8

# Sample radius of one anti-aliased activation (2x up, Kaiser-sinc kernel 12, 2x down), at the block's rate.
_ACTIVATION_RADIUS = 6


def audio_receptive_radius(config) -> int:
    """Return an upper bound, in latents, of how far one latent influences the decoded waveform (either side)."""
    radius = 3.0  # dec_in_proj is 1x1, BigVGAN conv_pre has kernel 7
    samples_per_latent = 1
    for rate, kernel in zip(config.decoder_rates, config.decoder_kernel_sizes):
        radius += -(-kernel // rate) / samples_per_latent  # transposed conv, in input samples
        samples_per_latent *= rate
        block = max(
            sum(2 * _ACTIVATION_RADIUS + d * (k - 1) // 2 + (k - 1) // 2 for d in dilations)
            for k, dilations in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes))
        radius += block / samples_per_latent
    radius += (_ACTIVATION_RADIUS + 3) / samples_per_latent  # activation_post + conv_post (kernel 7)
    return int(radius) + 1


def _for_mux(pixels: torch.Tensor) -> torch.Tensor:
    """Float RGB `[n, H, W, 3]` in the muxer's fastest input from its device: I420 planes `[n, H * 3 / 2, W]`
    converted on a GPU, uint8 RGB on a CPU (see `to_i420`)."""
    return to_i420(pixels) if pixels.is_cuda else to_uint8(pixels)


class IncrementalVideoDecoder:
    """Decode one phase of video latents at a time; see the module docstring for the context rule."""

    def __init__(self, decoder: VideoDecoder) -> None:
        self.decoder = decoder
        vae = decoder.vae
        self.clip_latents = vae.tokens_chunk_size
        """New latents per 17-frame clip (5)."""
        self.context_latents = vae.token_overlap
        """Latents carried into the next call (2)."""
        self.context_frames = vae.frame_overlap
        """Frames the carried latents decode to, held back from each call and given by the next one (5)."""
        self._context: torch.Tensor | None = None  # [2, 24, h, w] of the previous call
        self._carry = TemporalCarry()

    def reset(self) -> None:
        """Forget the carried context and the held frames; the next call starts a new stream."""
        self._context = None
        self._carry = TemporalCarry()

    @torch.inference_mode()
    def flush_pixels(self) -> torch.Tensor | None:
        """End the stream: return its held-back last frames as float RGB `[5, H, W, 3]` (None when none are held)
        and reset, so a next call starts a new stream."""
        held = self._carry.overlap
        self.reset()
        return None if held is None else self.decoder.to_rgb(held)

    @torch.inference_mode()
    def flush_for_mux(self) -> torch.Tensor | None:
        """`flush_pixels` in the muxer's input of `decode_parts_for_mux`."""
        pixels = self.flush_pixels()
        return None if pixels is None else _for_mux(pixels)

    def expected_frames(self, num_latents: int) -> int:
        """Return the frames the next `decode` of `num_latents` latents will return, or raise InvalidLatents."""
        if self._context is None:
            return self.decoder.num_frames(num_latents) - self.context_frames
        if num_latents < self.clip_latents or num_latents % self.clip_latents:
            raise InvalidLatents(
                f"after the first phase each phase must hold a multiple of {self.clip_latents} video latents "
                f"(5 latents = 17 frames), got {num_latents}")
        return self.decoder.num_frames(num_latents + self.context_latents) - self.context_frames

    def part_frames(self, num_latents: int) -> list[int]:
        """Return the frames of each part `decode_parts_for_mux` yields for the next call of `num_latents` latents,
        or raise InvalidLatents: on a stream's first call of two or more clips, its first clip's frames and then the
        rest (so a session's first chunk waits for one clip's decode, not the phase's); otherwise the whole call."""
        total = self.expected_frames(num_latents)
        if self._context is None and num_latents >= self.context_latents + 2 * self.clip_latents:
            first = self.decoder.num_frames(self.context_latents + self.clip_latents) - self.context_frames
            return [first, total - first]
        return [total]

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode one phase `[F, 24, h, w]` to uint8 frames `[N, H, W, 3]`."""
        return to_uint8(self.decode_pixels(latents))

    @torch.inference_mode()
    def decode_parts_for_mux(self, latents: torch.Tensor) -> Iterator[torch.Tensor]:
        """Decode one phase in the parts of `part_frames`, yielding each part's uint8 frames as soon as they are
        decoded, in the muxer's fastest input from this device: I420 planes `[n, H * 3 / 2, W]` converted on a GPU,
        RGB `[n, H, W, 3]` on a CPU (see `to_i420`). The parts' frames together are `decode`'s."""
        for pixels in self.pixel_parts(latents, split=True):
            yield _for_mux(pixels)

    @torch.inference_mode()
    def decode_pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode one phase `[F, 24, h, w]` to float RGB `[N, H, W, 3]` in [0, 1]."""
        (frames,) = self.pixel_parts(latents, split=False)
        return frames

    @torch.inference_mode()
    def pixel_parts(self, latents: torch.Tensor, split: bool) -> Iterator[torch.Tensor]:
        """Decode one phase `[F, 24, h, w]` to float RGB `[n, H, W, 3]` in [0, 1] in the parts of `part_frames` (one
        part unless `split`), yielding each part once decoded."""
        self.decoder.validate(latents)
        sizes = self.part_frames(latents.shape[0]) if split else [self.expected_frames(latents.shape[0])]
        latents = latents.to(self.decoder.device, torch.float32)
        context = self._context
        if context is not None:
            if context.shape[1:] != latents.shape[1:]:
                raise InvalidLatents(
                    f"video latent grid changed mid-stream: {tuple(context.shape[1:])} -> "
                    f"{tuple(latents.shape[1:])}; call reset() for a new canvas")
            latents = torch.cat([context, latents])  # latents: [2 + F, 24, h, w]
        head_clips = 1 if len(sizes) > 1 else 0
        for i, frames in enumerate(self.decoder.decode_pixel_parts(latents, head_clips, self._carry)):  # [n, H, W, 3]
            if frames.shape[0] != sizes[i]:  # a geometry mismatch would silently shift the timeline
                raise RuntimeError(f"video decode returned {frames.shape[0]} frames, expected {sizes[i]}")
            if i == len(sizes) - 1:
                self._context = latents[-self.context_latents:].clone()
            yield frames


WARMUP_PHASE_LATENTS = (12, 10, 5)
"""A stream's phase sizes: the first call (2 + 5k latents, 12 in request 0), then 10- and 5-latent phases."""


def warm_up_video(decoder: VideoDecoder, width: int, height: int) -> None:
    """Decode one stream of zero latents at this canvas through every phase size, so whatever the decoder compiles
    or tunes per shape happens now and not while serving."""
    stream = IncrementalVideoDecoder(decoder)
    grid = (decoder.vae.config.latent_channels, height // decoder.spatial_ratio, width // decoder.spatial_ratio)
    for num in WARMUP_PHASE_LATENTS:  # in the parts a session decodes them in
        for _ in stream.decode_parts_for_mux(torch.zeros(num, *grid)):  # [num, 24, h, w]
            pass


AUDIO_PHASE_LATENTS = (65, 56, 57, 28, 29)
"""A stream's audio latents per phase: the first phase (12 video latents), then 10- and 5-latent phases."""


def audio_graph_lengths(decoder: AudioDecoder) -> list[int]:
    """The latent lengths an `IncrementalAudioDecoder` hands its decoder: the first phase with its padding, then
    every later phase size with the carried context in front."""
    stream = IncrementalAudioDecoder(decoder)
    first, *later = AUDIO_PHASE_LATENTS
    return [first + stream.pad_latents] + [stream.context_latents + n + stream.pad_latents for n in later]


class IncrementalAudioDecoder:
    """Decode one phase of stereo audio latents at a time with left context and right padding."""

    def __init__(self, decoder: AudioDecoder, context_latents: int | None = None,
                 pad_latents: int | None = None) -> None:
        radius = audio_receptive_radius(decoder.vae.config)
        self.context_latents = radius if context_latents is None else context_latents
        """Latents of earlier phases decoded again in front of each phase (default: the receptive radius)."""
        self.pad_latents = radius if pad_latents is None else pad_latents
        """Copies of the phase's last latent appended behind it and decoded, then dropped (default: the radius)."""
        if self.context_latents < 0 or self.pad_latents < 0:
            raise ValueError(f"context_latents and pad_latents must be >= 0, got "
                             f"{self.context_latents} and {self.pad_latents}")
        self.decoder = decoder
        self._context: torch.Tensor | None = None  # [2, <=K, 32]

    def reset(self) -> None:
        """Forget the carried context; the next call starts a new stream."""
        self._context = None

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode one phase `[2, A, 32]` to float32 `[2, A * 800]` in [-1, 1]."""
        self.decoder.validate(latents)
        latents = latents.to(self.decoder.device, torch.float32)
        num_new = latents.shape[1]
        num_context = 0 if self._context is None else self._context.shape[1]
        parts = [latents, latents[:, -1:].expand(-1, self.pad_latents, -1)]
        if num_context:
            parts.insert(0, self._context)
        wave = self.decoder.decode(torch.cat(parts, dim=1))  # wave: [2, (K + A + P) * hop]
        if self.context_latents:
            history = latents if self._context is None else torch.cat([self._context, latents], dim=1)
            self._context = history[:, -self.context_latents:].clone()
        hop = self.decoder.hop_length
        return wave[:, num_context * hop:(num_context + num_new) * hop]

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

Audio: the BigVGAN decoder is a stack of non-causal convolutions, and TaoMate-H3 decodes the session's audio once.
Each call decodes `[the last latents received before it | new latents | last new latent repeated pad_latents times]`
and returns the samples from where the last call stopped up to its cut. Every sample with at least the decoder's
receptive radius of true latents on both sides equals the whole decode (within float reassociation). The left side
always has them: the carried latents reach `context_latents` (the radius) in front of the first sample returned. On
the right, a sample near the end of the latents received is computed from padding where the whole decode has the
next phase's latents, so the cut holds samples back: the session cuts where its emitted video ends (the video
decoder holds each phase's last 5 frames, 208 ms, about 8 latents, for the next phase), so every phase boundary gets
that much true right context at no extra A/V latency, and `right_context_latents` can ask for more (the radius:
exact), its audio then waiting longer than its video. The held samples come with the next call; `flush()` decodes the
last ones as the whole decode ends (no padding). The repeated-latent padding keeps the decoder's end-of-signal edge
effect out of what the right context does not cover: with no right context (the cut at the end of the latents, as
this decoder worked before) the RMS error inside the last radius of each phase was about 7% of the signal on tiny
random weights; docs/decisions.md has the figures per right context.
"""
from __future__ import annotations

import math
from fractions import Fraction
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


def audio_graph_lengths(decoder: AudioDecoder, right_context_latents: int = 0, held_latents: int = 0) -> list[int]:
    """The latent lengths an `IncrementalAudioDecoder` of these settings hands its decoder: the first phase with its
    padding, every later phase size with the carried window in front, and the flush at the stream's end."""
    stream = IncrementalAudioDecoder(decoder, right_context_latents, held_latents)
    first, *later = AUDIO_PHASE_LATENTS
    window = stream.window_latents
    return [first + stream.pad_latents] + [window + n + stream.pad_latents for n in later] + [window]


def held_audio_latents(held_frames: int, fps: int, sample_rate: int, hop: int) -> int:
    """Return the most audio latents a stream holds back behind its latents received when its audio is cut where
    its emitted video ends, `held_frames` before the video's latents end: a phase's audio ends within half a latent
    of its last frame (the DiT's `audio_boundary`), so the held audio spans the frames plus at most half a latent."""
    return math.ceil(Fraction(held_frames * sample_rate, fps * hop) + Fraction(1, 2))


class IncrementalAudioDecoder:
    """Decode one phase of stereo audio latents at a time with left context, held-back right context and right
    padding; see the module docstring."""

    def __init__(self, decoder: AudioDecoder, right_context_latents: int = 0, held_latents: int = 0,
                 context_latents: int | None = None, pad_latents: int | None = None) -> None:
        radius = audio_receptive_radius(decoder.vae.config)
        self.radius = radius
        """The decoder's receptive radius in latents: a right context this long makes every sample exact."""
        self.right_context_latents = right_context_latents
        """Latents of true right context every returned sample has at least: a call returns no sample within this
        many latents of the end of the latents received; a later call, or `flush`, returns them."""
        self.held_latents = held_latents
        """The most latents a call's `until` may hold back behind the end of the latents received."""
        self.context_latents = radius if context_latents is None else context_latents
        """Latents decoded again in front of the first sample a call returns (default: the receptive radius)."""
        default_pad = radius if right_context_latents < radius else 0  # with the whole radius the pad reaches nothing
        self.pad_latents = default_pad if pad_latents is None else pad_latents
        """Copies of the last latent received appended behind it and decoded, then dropped (default: the radius)."""
        if min(self.context_latents, self.pad_latents, right_context_latents, held_latents) < 0:
            raise ValueError(f"context_latents, pad_latents, right_context_latents and held_latents must be >= 0, "
                             f"got {self.context_latents}, {self.pad_latents}, {right_context_latents} and "
                             f"{held_latents}")
        self.window_latents = self.context_latents + max(right_context_latents, held_latents)
        """Latents received earlier that every call decodes again in front of its new ones (fewer at first)."""
        self.decoder = decoder
        self._window: torch.Tensor | None = None  # [2, <=window_latents, 32]: the last latents received
        self._received = 0  # latents per channel received
        self._returned = 0  # samples per channel returned

    @property
    def returned_samples(self) -> int:
        """Samples per channel returned so far in this stream (where the next call's samples start)."""
        return self._returned

    def reset(self) -> None:
        """Forget the carried latents and the held samples; the next call starts a new stream."""
        self._window, self._received, self._returned = None, 0, 0

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, until: int | None = None) -> torch.Tensor:
        """Decode one phase `[2, A, 32]` and return float32 `[2, S]` in [-1, 1]: the stream's samples from where the
        last call's ended up to `until` (default: the end of the latents received) and no further than
        `right_context_latents` before that end."""
        self.decoder.validate(latents)
        latents = latents.to(self.decoder.device, torch.float32)
        hop = self.decoder.hop_length
        end = (self._received + latents.shape[1]) * hop
        until = end if until is None else until
        if not end - self.held_latents * hop <= until <= end:
            raise ValueError(f"until={until}: must lie within {self.held_latents} latents ({self.held_latents * hop} "
                             f"samples) of the {end} samples received")
        cut = max(self._returned, min(until, end - self.right_context_latents * hop))
        parts = [latents, latents[:, -1:].expand(-1, self.pad_latents, -1)]
        if self._window is not None:
            parts.insert(0, self._window)
        return self._advance(torch.cat(parts, dim=1), latents, cut)  # [2, W + A + P] latents

    @torch.inference_mode()
    def flush(self) -> torch.Tensor:
        """End the stream: return its held-back samples `[2, S]` (S may be 0), decoded as the whole session's
        decode ends it (no padding), and reset, so a next call starts a new stream."""
        if self._window is None or self._returned == self._received * self.decoder.hop_length:
            self.reset()
            return torch.zeros(2, 0)
        wave = self._advance(self._window, self._window[:, :0], self._received * self.decoder.hop_length)
        self.reset()
        return wave

    def _advance(self, window: torch.Tensor, latents: torch.Tensor, cut: int) -> torch.Tensor:
        """Decode `window` (the carried latents, then `latents` and any padding), return its samples from the last
        cut to `cut`, and carry the latents received on."""
        hop = self.decoder.hop_length
        start = (self._received - (0 if self._window is None else self._window.shape[1])) * hop  # window's 1st sample
        wave = self.decoder.decode(window)  # wave: [2, (W + A + P) * hop]
        out = wave[:, self._returned - start:cut - start]
        history = latents if self._window is None else torch.cat([self._window, latents], dim=1)
        self._window = history[:, -self.window_latents:].clone() if self.window_latents else history[:, :0]
        self._received += latents.shape[1]
        self._returned = cut
        return out

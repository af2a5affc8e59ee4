"""Audio at phase boundaries: the streamed audio against the whole-session decode, per right context.

Knows nothing about the muxer or gRPC: it builds an audio VAE of a preset with random weights on `--device` (the
CPU by default), streams random latents through `IncrementalAudioDecoder` in a session's phase sizes (request 0, then later
requests), and prints, for each right context, the error at the phase boundaries against one decode of all the
latents (TaoMate-H3's), the A/V latency the held audio adds beyond the video's held frames, and the decode time
per phase. `video` is the session's default: the audio cut where the emitted video ends.

    python -m tools.vae.audio_boundaries --preset tiny
    python -m tools.vae.audio_boundaries --preset full --phases 4 --device cuda:0
"""
from __future__ import annotations

import argparse
import time
from fractions import Fraction

import torch

from services.common.media import AUDIO_SAMPLE_RATE, VIDEO_FPS
from services.vae.incremental import IncrementalAudioDecoder, held_audio_latents
from services.vae.model import AudioDecoder, build_audio_vae

HELD_FRAMES = 5
"""Frames the video decoder holds back at the end of every phase (its overlap frames)."""
SESSION_PHASE_FRAMES = (39, 34, 34, 17) + (34, 34, 34, 17) * 3
"""Frames of a session's phases: request 0 (a 5-frame prefix in its first), then later requests."""


def phase_plan(num_phases: int, hop: int) -> tuple[list[int], list[int]]:
    """Return each phase's audio latents (its end rounded to the latent grid, as the DiT's `audio_boundary`) and
    the samples the session's audio is cut at after it (where its emitted video ends)."""
    latents, cuts, frames, total = [], [], 0, 0
    for n in SESSION_PHASE_FRAMES[:num_phases]:
        frames += n
        end = round(Fraction(frames * AUDIO_SAMPLE_RATE, VIDEO_FPS * hop))
        latents.append(end - total)
        total = end
        cuts.append((frames - HELD_FRAMES) * AUDIO_SAMPLE_RATE // VIDEO_FPS)
    return latents, cuts


def stream(decoder: AudioDecoder, z: torch.Tensor, plan: list[int], cuts: list[int] | None, right: int
           ) -> tuple[torch.Tensor, float]:
    """Stream `z` in the phases of `plan`; return the audio and the mean decode seconds of a phase."""
    held = held_audio_latents(HELD_FRAMES, VIDEO_FPS, AUDIO_SAMPLE_RATE, decoder.hop_length) if cuts else 0
    inc = IncrementalAudioDecoder(decoder, right_context_latents=right, held_latents=held)
    outs, start, seconds = [], 0, 0.0
    for i, n in enumerate(plan):
        t0 = time.perf_counter()
        outs.append(inc.decode(z[:, start:start + n], until=cuts[i] if cuts else None))
        seconds += time.perf_counter() - t0
        start += n
    outs.append(inc.flush())
    return torch.cat(outs, dim=1), seconds / len(plan)


def boundary_errors(streamed: torch.Tensor, whole: torch.Tensor, plan: list[int], radius: int, hop: int
                    ) -> list[tuple[float, float]]:
    """Per phase boundary: the peak absolute error and the RMS error over the signal's RMS, within the receptive
    radius on either side of the boundary."""
    errors, end = [], 0
    for n in plan[:-1]:
        end += n
        window = slice((end - radius) * hop, (end + radius) * hop)
        diff, ref = streamed[:, window] - whole[:, window], whole[:, window]
        errors.append((diff.abs().max().item(), (diff.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()))
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=["tiny", "full"])
    parser.add_argument("--phases", type=int, default=8, help="phases streamed (request 0 has 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the VAE is built and decodes, e.g. cuda:0")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    with device:  # the full-size VAE's random init on the device, not on the CPU first
        vae = build_audio_vae(args.preset)
    decoder = AudioDecoder(vae.to(device))
    hop = decoder.hop_length
    plan, cuts = phase_plan(args.phases, hop)
    z = torch.randn(2, sum(plan), decoder.vae.config.latent_channels,
                    generator=torch.Generator().manual_seed(args.seed))
    t0 = time.perf_counter()
    whole = decoder.decode(z)
    whole_seconds = time.perf_counter() - t0
    radius = IncrementalAudioDecoder(decoder).radius
    video_hold = Fraction(HELD_FRAMES, VIDEO_FPS)
    latents_per_second = decoder.sample_rate // hop
    print(f"preset {args.preset}: {args.phases} phases {plan}, {sum(plan)} latents; receptive radius {radius} "
          f"latents; whole decode {whole_seconds:.2f} s; device {device}; torch threads {torch.get_num_threads()}")
    print("right context | boundary peak abs error            | boundary RMS error / RMS (mean, max) | "
          "added A/V latency | decode s/phase")
    for label, right, aligned in [("0", 0, False), ("video (~8.3)", 0, True), ("8", 8, False),
                                  ("16", 16, False), ("24", 24, False), (f"exact ({radius})", radius, False)]:
        streamed, seconds = stream(decoder, z, plan, cuts if aligned else None, right)
        assert streamed.shape == whole.shape
        errors = boundary_errors(streamed, whole, plan, radius, hop)
        peaks, rms = [e[0] for e in errors], [e[1] for e in errors]
        added = max(Fraction(0), Fraction(right, latents_per_second) - video_hold)  # beyond the video's 208 ms
        print(f"{label:>13} | max {max(peaks):.2e} ({', '.join(f'{p:.0e}' for p in peaks)}) | "
              f"{sum(rms) / len(rms):.2e}, {max(rms):.2e} | {float(added) * 1000:6.0f} ms | {seconds:.3f}")


if __name__ == "__main__":
    main()

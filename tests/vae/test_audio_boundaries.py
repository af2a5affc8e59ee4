"""Streamed audio at phase boundaries against the whole-session decode (tiny preset, CPU).

TaoMate-H3 decodes a session's audio once. The session cuts each phase's audio where its emitted video ends (the
video decoder holds the last 5 frames back), so the audio of those frames, about 8 latents, is the true right
context of every boundary. Tolerance with that default: 1e-5 absolute everywhere (1e-7 measured on these weights,
where the tiny decoder's effective reach is under 8 latents; the full-size figures are in docs/decisions.md); with
the receptive radius ("exact") 1e-5 too, float reassociation only.
"""
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from services.common.config import VAEConfig
from services.common.media import AUDIO_SAMPLE_RATE, VIDEO_FPS
from services.vae.checkpoint import load_audio_vae, load_video_vae, write_random_checkpoint
from services.vae.incremental import IncrementalAudioDecoder
from services.vae.model import AudioDecoder, VideoDecoder
from services.vae.service import DecodeSession

pytestmark = [pytest.mark.cpu, pytest.mark.slow]  # each test decodes whole streams three ways: seconds each

WIDTH, HEIGHT = 96, 64
PHASES = [(12, 65), (10, 57), (10, 56), (5, 29)]  # request 0: 39, 34, 34, 17 frames


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    ckpt = write_random_checkpoint("tiny", tmp_path_factory.mktemp("vae"), seed=11)
    return VideoDecoder(load_video_vae(ckpt)), AudioDecoder(load_audio_vae(ckpt))


@pytest.fixture(scope="module")
def phases():
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(v, 24, HEIGHT // 16, WIDTH // 16, generator=gen), torch.randn(2, a, 32, generator=gen))
            for v, a in PHASES]


@pytest.fixture(scope="module")
def whole(decoders, phases):
    return decoders[1].decode(torch.cat([a for _, a in phases], dim=1))


def _stream(decoders, phases, right_context):
    video, audio = decoders
    with ThreadPoolExecutor(1, "vae-audio") as worker:
        session = DecodeSession(video, audio, WIDTH, HEIGHT, VIDEO_FPS, AUDIO_SAMPLE_RATE, "ultrafast",
                                threading.Lock(), worker, audio_right_context=right_context)
        samples, chunks = [], []
        real = session.mux.encode_audio
        session.mux.encode_audio = lambda s: (samples.append(s.copy()), real(s))[1]
        for v, a in phases:
            chunks += list(session.phase(v, a))
        chunks.append(session.close())
    return torch.from_numpy(np.concatenate(samples, axis=1)), chunks


def test_default_right_context_matches_the_whole_decode_and_keeps_chunks_on_their_video(decoders, phases, whole):
    streamed, chunks = _stream(decoders, phases, 0)
    assert streamed.shape == whole.shape
    torch.testing.assert_close(streamed, whole, rtol=0, atol=1e-5)
    # every chunk's audio spans exactly its frames (floor-rounded cuts on the 32 kHz grid), the trailer's included
    frames = samples = 0
    for chunk in chunks:
        frames += chunk.num_frames
        samples += chunk.num_audio_samples
        if chunk is not chunks[-1]:
            assert samples == frames * AUDIO_SAMPLE_RATE // VIDEO_FPS
    assert frames == 124 and samples == sum(a for _, a in PHASES) * 800
    assert chunks[-1].num_frames == 5 and chunks[-1].num_audio_samples == samples - 119 * AUDIO_SAMPLE_RATE // 24


def test_the_old_cut_at_the_phase_end_is_visibly_off(decoders, phases, whole):
    # no right context (each phase's audio up to its last latent, padded): the test can tell it from the above
    inc = IncrementalAudioDecoder(decoders[1])
    streamed = torch.cat([inc.decode(a) for _, a in phases] + [inc.flush()], dim=1)
    end = 65 * 800
    assert (streamed[:, end - 8 * 800:end] - whole[:, end - 8 * 800:end]).abs().max() > 1e-3


def test_exact_right_context_is_the_whole_decode(decoders, phases, whole):
    radius = IncrementalAudioDecoder(decoders[1]).radius
    streamed, chunks = _stream(decoders, phases, radius)
    torch.testing.assert_close(streamed, whole, rtol=0, atol=1e-5)
    # the audio of each phase's last `radius` latents waits for the next phase: the last chunk of request 0's
    # first phase carries its video's audio less (radius - 8.3 latents); the trailer brings the rest
    assert sum(c.num_audio_samples for c in chunks) == whole.shape[1]
    assert chunks[-1].num_audio_samples == radius * 800


def test_held_audio_beyond_what_the_call_allows_is_refused(decoders, phases):
    inc = IncrementalAudioDecoder(decoders[1], held_latents=9)
    with pytest.raises(ValueError, match="until=100: must lie within 9 latents"):
        inc.decode(phases[0][1], until=100)


@pytest.mark.parametrize("value", [-1, 65, 8.5, True, "radius"])
def test_the_profile_option_is_validated(value):
    with pytest.raises(ValueError, match="vae.audio_right_context"):
        VAEConfig(audio_right_context=value)
    assert VAEConfig(audio_right_context="exact").audio_right_context == "exact"

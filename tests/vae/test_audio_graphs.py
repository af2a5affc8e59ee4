"""The audio decoder as CUDA graphs (`vae.cuda_graphs`): a stream hands the decoder only the captured latent lengths,
and a replay equals the eager decode bitwise."""

import pytest
import torch

from services.common.config import VAEConfig
from services.vae.checkpoint import load_audio_vae, write_random_checkpoint
from services.vae.incremental import AUDIO_PHASE_LATENTS, IncrementalAudioDecoder, audio_graph_lengths
from services.vae.model import AudioDecoder


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint("tiny", tmp_path_factory.mktemp("vae"), seed=11)


def _phases(latents: torch.Tensor, counts: list[int]):
    start = 0
    for n in counts:
        yield latents[:, start:start + n]
        start += n


@pytest.mark.cpu
def test_graphs_need_cuda():
    with pytest.raises(ValueError, match="vae.cuda_graphs is true but vae.device is 'cpu'"):
        VAEConfig(cuda_graphs=True)


@pytest.mark.cpu
def test_audio_phase_sizes_are_the_dit_plan_s():
    from services.dit.stream.geometry import plan_request

    first = plan_request(0).phases[0].num_audio_latents
    later = {ph.num_audio_latents for k in range(60) for ph in plan_request(k).phases} - {first}
    assert AUDIO_PHASE_LATENTS[0] == first and set(AUDIO_PHASE_LATENTS[1:]) == later


def _graphed_stream(decoder: AudioDecoder, z: torch.Tensor) -> list[torch.Tensor]:
    """Two streams over `z` (the second after a reset), the phases of requests 0 and 1 and a 28-latent phase."""
    counts = [65, 57, 56, 29, 57, 56, 56, 28]
    outs = []
    for _ in range(2):
        inc = IncrementalAudioDecoder(decoder)
        outs += [inc.decode(p) for p in _phases(z, counts)]
    return outs


@pytest.mark.cpu
@pytest.mark.slow
def test_a_stream_decodes_only_the_captured_lengths(ckpt):
    # On the CPU the bank runs eagerly, with the same keys and miss count as on a GPU.
    graphed = AudioDecoder(load_audio_vae(ckpt))
    graphed.capture_graphs(audio_graph_lengths(graphed))
    z = torch.randn(2, 454, 32, generator=torch.Generator().manual_seed(5))
    outs = _graphed_stream(graphed, z)
    assert graphed.graphs.stats.misses == 0 and len(graphed.graphs) == len(AUDIO_PHASE_LATENTS) + 1  # and the flush
    ref = _graphed_stream(AudioDecoder(load_audio_vae(ckpt)), z)
    assert all(torch.equal(a, b) for a, b in zip(outs, ref))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_audio_graph_replay_equals_the_eager_decode_bitwise_on_gpu(ckpt):
    eager = AudioDecoder(load_audio_vae(ckpt, "cuda"))
    graphed = AudioDecoder(load_audio_vae(ckpt, "cuda"))
    graphed.capture_graphs(audio_graph_lengths(graphed))
    z = torch.randn(2, 454, 32, generator=torch.Generator().manual_seed(5))
    outs, ref = _graphed_stream(graphed, z), _graphed_stream(eager, z)
    stats = graphed.graphs.stats
    assert stats.misses == 0 and stats.replays == len(outs)
    assert all(torch.equal(a, b) for a, b in zip(outs, ref))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_audio_decodes_on_its_own_stream_not_behind_the_default_stream_s_work(ckpt):
    # The VAE's audio thread decodes while the video's ViT kernels fill the legacy default stream; on the decoder's
    # own stream the samples come back (the same bits) while that work is still running.
    decoder = AudioDecoder(load_audio_vae(ckpt, "cuda"))
    decoder.capture_graphs(audio_graph_lengths(decoder))
    z = torch.randn(2, 65, 32, generator=torch.Generator().manual_seed(5)).cuda()
    ref = IncrementalAudioDecoder(decoder).decode(z)
    ready = torch.cuda.Event()
    ready.record()
    a = torch.randn(8192, 8192, device="cuda")
    for _ in range(30):  # ~0.5 s of queued default-stream work
        a = torch.tanh(a @ a)
    with decoder.own_stream(ready):
        out = IncrementalAudioDecoder(decoder).decode(z)
    assert not torch.cuda.default_stream().query(), "the audio decode waited for the default stream's work"
    torch.cuda.synchronize()
    assert decoder.stream != torch.cuda.default_stream() and torch.equal(out, ref)

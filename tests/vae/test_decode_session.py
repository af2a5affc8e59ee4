"""The VAE service's per-stream decode: audio decoded in a worker thread beside the video, bytes unchanged."""
import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from services.common.errors import InvalidInput
from services.common.media import AUDIO_SAMPLE_RATE, VIDEO_FPS
from services.tensors.transport import tensor_to_parts
from services.vae.checkpoint import load_audio_vae, load_video_vae, write_random_checkpoint
from services.vae.grpc_server import VAEServicer
from services.vae.incremental import IncrementalAudioDecoder, IncrementalVideoDecoder
from services.vae.model import AudioDecoder, VideoDecoder
from services.vae.mux import FragmentedMP4Muxer
from services.vae.service import DecodeSession
from vitascope.vae.v1 import vae_pb2, vae_pb2_grpc

pytestmark = pytest.mark.cpu

WIDTH, HEIGHT = 96, 64
PHASES = [(12, 65), (10, 57), (5, 28)]  # (video latents, audio latents per channel): 39, 73, 90 frames at 40 Hz


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    ckpt = write_random_checkpoint("tiny", tmp_path_factory.mktemp("vae"), seed=5)
    return VideoDecoder(load_video_vae(ckpt)), AudioDecoder(load_audio_vae(ckpt))


@pytest.fixture(scope="module")
def worker():
    pool = ThreadPoolExecutor(1, "vae-audio")
    yield pool
    pool.shutdown()


def latents(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(v, 24, HEIGHT // 16, WIDTH // 16, generator=gen), torch.randn(2, a, 32, generator=gen))
            for v, a in PHASES]


def session(decoders, worker) -> DecodeSession:
    video, audio = decoders
    return DecodeSession(video, audio, WIDTH, HEIGHT, VIDEO_FPS, AUDIO_SAMPLE_RATE, "ultrafast", threading.Lock(),
                         worker)


@pytest.mark.slow
def test_phases_give_the_bytes_of_decoding_one_after_the_other(decoders, worker):
    video, audio = decoders
    vdec = IncrementalVideoDecoder(video)
    mux = FragmentedMP4Muxer(WIDTH, HEIGHT, fps=VIDEO_FPS, sample_rate=AUDIO_SAMPLE_RATE,
                             codec_options={"preset": "ultrafast"})
    phases = latents(1)
    (v0, a0), rest = phases[0], phases[1:]
    # the stream's first phase goes out as its first 5 frames, the other 12 of its first clip, then the rest, each
    # with the audio up to its last frame
    head, tail = vdec.decode_parts_for_mux(v0)
    # the audio is cut where the emitted video ends: the 5 held-back frames' audio waits for the next phase
    rate = lambda frames: frames * AUDIO_SAMPLE_RATE // VIDEO_FPS  # noqa: E731
    adec = IncrementalAudioDecoder(audio, held_latents=9)
    samples = adec.decode(a0, until=rate(34)).numpy()
    cut5, cut17 = rate(5), rate(17)
    want = [mux.encode(head[:5].numpy(), samples[:, :cut5]), mux.encode(head[5:].numpy(), samples[:, cut5:cut17]),
            mux.encode(tail.numpy(), samples[:, cut17:])]
    want += [mux.encode(vdec.decode(v).numpy(), adec.decode(a, until=rate(end)).numpy())
             for (v, a), end in zip(rest, [68, 85])]
    # closing: the 5 frames the video decoder held back (the whole decode's last) with their audio, then the AAC
    # encoder's tail
    want.append(mux.encode(vdec.flush_for_mux().numpy(), adec.flush().numpy()) + mux.close())
    stream = session(decoders, worker)
    chunks = [c for v, a in phases for c in stream.phase(v, a)]
    last = stream.close()
    assert [c.data for c in chunks] + [last.data] == want
    assert [(c.num_frames, c.num_audio_samples, c.phase_continues) for c in chunks] == [
        (5, cut5, True), (12, cut17 - cut5, True), (17, rate(34) - cut17, False), (34, rate(68) - rate(34), False),
        (17, rate(85) - rate(68), False)]
    assert last.num_frames == 5 and last.num_audio_samples == (65 + 57 + 28) * 800 - rate(85)
    assert [c.video_decode_seconds > 0 for c in chunks[:3]] == [True, False, True]  # the decode is the part's


def test_the_first_chunk_goes_out_before_the_rest_of_the_first_phase_is_decoded(decoders, worker, monkeypatch):
    stream = session(decoders, worker)
    decoded = []
    real = stream.video.decoder.decode_pixel_parts

    def parts(latents, head_clips, carry):
        for frames in real(latents, head_clips, carry):
            decoded.append(frames.shape[0])
            yield frames
    monkeypatch.setattr(stream.video.decoder, "decode_pixel_parts", parts)
    chunks = stream.phase(*latents(2)[0])
    first = next(chunks)
    assert decoded == [17] and first.phase_continues and first.data.startswith(b"\x00\x00\x00")
    assert first.num_frames == 5
    assert next(chunks).num_frames == 12 and decoded == [17]  # the rest of the first clip, before the next decode
    assert [c.num_frames for c in chunks] == [17] and decoded == [17, 17]


def test_audio_decodes_in_the_worker_while_the_video_decodes(decoders, worker, monkeypatch):
    stream = session(decoders, worker)
    seen = {}
    def video_spy(x, real=stream.video.decode_parts_for_mux):
        started = time.perf_counter()
        yield from real(x)
        seen["video"] = (threading.current_thread().name, started, time.perf_counter())

    def audio_spy(x, real=stream.audio.decode, **kwargs):
        started = time.perf_counter()
        out = real(x, **kwargs)
        seen["audio"] = (threading.current_thread().name, started, time.perf_counter())
        return out
    monkeypatch.setattr(stream.video, "decode_parts_for_mux", video_spy)
    monkeypatch.setattr(stream.audio, "decode", audio_spy)
    chunk = list(stream.phase(*latents(2)[0]))[0]
    assert seen["video"][0] == threading.current_thread().name
    assert seen["audio"][0].startswith("vae-audio")
    assert seen["audio"][1] < seen["video"][2]  # the audio started before the video was done
    assert chunk.audio_decode_seconds > 0 and chunk.video_decode_seconds > 0


BAD_PHASES = {  # the second phase (10 video latents, 57 audio latents a channel), spoilt
    "audio": (lambda v, a: (v, a[:1]), r"audio latents must be \[2, A, 32\]"),
    "video": (lambda v, a: (v[:7], a), "after the first phase each phase must hold a multiple of 5 video latents"),
    # 73 frames span 121.67 latents at 40 Hz: 65 + 56 leaves the phase's last 27 ms silent, 65 + 58 runs ahead
    "short audio": (lambda v, a: (v, a[:, :-1]), "this phase's 56 bring the stream to 121 per channel, but its 73 "
                    r"frames span 121.67 \(40 per second at 24 fps\); the phase needs 57"),
    "long audio": (lambda v, a: (v, torch.cat([a, a[:, -1:]], 1)), "this phase's 58 bring the stream to 123"),
}


@pytest.mark.slow
@pytest.mark.parametrize("bad", BAD_PHASES)
def test_a_bad_phase_is_named_and_advances_neither_decoder(decoders, worker, bad):
    spoil, message = BAD_PHASES[bad]
    phases = latents(3)
    reference = session(decoders, worker)
    want = [[c.data for c in reference.phase(v, a)] for v, a in phases]
    stream = session(decoders, worker)
    list(stream.phase(*phases[0]))
    with pytest.raises(InvalidInput, match=message):
        stream.phase(*spoil(*phases[1]))
    assert [[c.data for c in stream.phase(v, a)] for v, a in phases[1:]] == want[1:]


def test_a_stream_at_another_frame_rate_is_refused(decoders, worker):
    video, audio = decoders
    with pytest.raises(InvalidInput, match="fps=30: the video decoder's frames are 24 per second"):
        DecodeSession(video, audio, WIDTH, HEIGHT, 30, AUDIO_SAMPLE_RATE, "ultrafast", threading.Lock(), worker)


def test_a_phase_left_after_its_first_chunk_frees_the_shared_decoders(decoders, worker):
    video, audio = decoders
    lock = threading.Lock()
    stream = DecodeSession(video, audio, WIDTH, HEIGHT, VIDEO_FPS, AUDIO_SAMPLE_RATE, "ultrafast", lock, worker)
    chunks = stream.phase(*latents(4)[0])
    assert next(chunks).phase_continues and lock.locked()
    chunks.close()  # a cancelled stream: the rest of the phase is never asked for
    assert not lock.locked()


class SharedDecoders:
    """VAEService.open's sharing: one pair of decoders, one lock, one audio worker, one decode thread; keeps the
    sessions it opened."""

    def __init__(self, decoders, worker):
        self.video, self.audio = decoders
        self.worker = worker
        self.decode_worker = ThreadPoolExecutor(1, "vae-decode")
        self.lock = threading.Lock()
        self.sessions: list[DecodeSession] = []

    def open(self, width, height, fps, sample_rate):
        session = DecodeSession(self.video, self.audio, width, height, fps, sample_rate, "ultrafast", self.lock,
                                self.worker)
        self.sessions.append(session)
        return session


@contextlib.asynccontextmanager
async def vae_stub(service):
    """A VAE gRPC server over `service` on a free port; yields its stub."""
    server = grpc.aio.server()
    vae_pb2_grpc.add_VAEServicer_to_server(VAEServicer(service), server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        async with grpc.aio.insecure_channel(addr) as channel:
            yield vae_pb2_grpc.VAEStub(channel)
    finally:
        await server.stop(0)


def decode_requests(session_id, phases, labels):
    yield vae_pb2.DecodeRequest(start=vae_pb2.DecodeStart(session_id=session_id, width=WIDTH, height=HEIGHT))
    for (v, a), (request_index, phase_index) in zip(phases, labels):
        yield from (vae_pb2.DecodeRequest(video=p) for p in tensor_to_parts(v))
        yield from (vae_pb2.DecodeRequest(audio=p) for p in tensor_to_parts(a))
        yield vae_pb2.DecodeRequest(phase_end=vae_pb2.PhaseEnd(request_index=request_index, phase_index=phase_index))


@pytest.mark.slow
async def test_more_concurrent_decode_calls_than_worker_threads_all_finish(decoders, worker):
    # a session's chunks hold the shared lock from its first chunk to its last: sessions waiting for it in worker
    # threads once filled the event loop's pool, and the holder could not make its next chunk (every call hung)
    service = SharedDecoders(decoders, worker)  # one decode thread for six calls
    async with vae_stub(service) as stub:
        async def call(seed: int) -> int:
            responses = [r async for r in stub.Decode(decode_requests(f"s{seed}", latents(seed)[:1], [(0, 0)]))]
            return sum(r.WhichOneof("end") in ("phase_continues", "phase_done") for r in responses)

        counts = await asyncio.wait_for(asyncio.gather(*(call(i) for i in range(6))), 120)
    assert counts == [3] * 6 and not service.lock.locked()  # the first phase of each: three chunks
    assert not any(session.mux.holds_encoders for session in service.sessions)


async def test_every_stream_runs_on_the_services_decode_thread(decoders, worker, monkeypatch):
    # on the event loop's default executor the work ran on whichever of its lazily started threads was free: a
    # thread added late in a soak ran torch and grew an OpenMP team and a heap of its own
    threads = set()

    def recorded(method):
        def call(self, *args):
            threads.add(threading.current_thread().name)
            return method(self, *args)
        return call

    monkeypatch.setattr(SharedDecoders, "open", recorded(SharedDecoders.open))
    for name in ("encode_video", "close", "discard"):
        monkeypatch.setattr(FragmentedMP4Muxer, name, recorded(getattr(FragmentedMP4Muxer, name)))
    service = SharedDecoders(decoders, worker)
    async with vae_stub(service) as stub:
        async def call(seed: int) -> None:
            async for _ in stub.Decode(decode_requests(f"s{seed}", latents(seed)[:2], [(0, 0), (0, 1)])):
                pass

        await asyncio.wait_for(asyncio.gather(*(call(i) for i in range(3))), 120)
    assert threads == {"vae-decode_0"}


async def test_a_phase_out_of_order_fails_the_call_by_name(decoders, worker):
    service = SharedDecoders(decoders, worker)
    chunks = []
    async with vae_stub(service) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for response in stub.Decode(decode_requests("s", latents(7)[:2], [(1, 0), (0, 3)])):
                chunks.append(response.chunk_index)
    assert "phase_end of (request, phase) (0, 3) after (1, 0)" in info.value.details()
    assert sorted(set(chunks)) == [0, 1, 2]  # the first phase's three chunks went out; nothing of the second
    assert not service.lock.locked()
    assert not service.sessions[0].mux.holds_encoders  # the failed call's encoders were freed with it


async def test_a_cancelled_call_frees_its_streams_encoders(decoders, worker):
    service = SharedDecoders(decoders, worker)
    async with vae_stub(service) as stub:
        call = stub.Decode(decode_requests("s", latents(8)[:2], [(0, 0), (0, 1)]))
        await call.read()  # the first chunk is out: the stream's encoders are running
        assert service.sessions[0].mux.holds_encoders
        call.cancel()
        for _ in range(100):
            if not service.sessions[0].mux.holds_encoders:
                break
            await asyncio.sleep(0.05)
    assert not service.sessions[0].mux.holds_encoders and not service.lock.locked()

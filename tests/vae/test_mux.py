"""FragmentedMP4Muxer: byte layout per chunk, and what PyAV (FFmpeg) decodes back from the stream."""
from __future__ import annotations

import io
import os
import struct

import av
import numpy as np
import pytest

from services.common.errors import InvalidInput, SequenceMismatch
from services.vae.mux import AAC_FRAME_SAMPLES, FragmentedMP4Muxer, MuxError, parse_boxes

pytestmark = pytest.mark.cpu

W, H, FPS, SR = 96, 64, 24, 32000
CHUNKS = (39, 34, 34, 17)


def _samples_for(frames_before: int, frames: int) -> int:
    """Audio samples matching `frames` video frames, rounded so the running total never drifts."""
    return round((frames_before + frames) * SR / FPS) - round(frames_before * SR / FPS)


def _chunk(rng: np.random.Generator, frames_before: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    # frames: [N, H, W, 3] uint8; audio: [2, S] float32 (a tone per channel, continuous across chunks)
    start = round(frames_before * SR / FPS)
    t = (start + np.arange(_samples_for(frames_before, n))) / SR
    audio = 0.3 * np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 660 * t)]).astype(np.float32)
    base = rng.integers(0, 255, (1, H, W, 3), dtype=np.uint8)
    frames = np.clip(base.astype(np.int16) + np.arange(n)[:, None, None, None], 0, 255).astype(np.uint8)
    return frames, audio


@pytest.fixture(scope="module")
def session() -> dict:
    muxer = FragmentedMP4Muxer(W, H, fps=FPS, sample_rate=SR)
    rng = np.random.default_rng(0)
    outputs, done = [], 0
    for n in CHUNKS:
        outputs.append(muxer.encode(*_chunk(rng, done, n)))
        done += n
    trailer = muxer.close()
    return {"muxer": muxer, "chunks": outputs, "trailer": trailer, "frames": done,
            "samples": round(done * SR / FPS)}


def _types(data: bytes) -> list[str]:
    return [b.type for b in parse_boxes(data)]


def test_first_chunk_is_init_then_one_fragment(session):
    first = session["chunks"][0]
    assert _types(first) == ["ftyp", "moov", "moof", "mdat"]
    init = session["muxer"].init_segment
    assert first.startswith(init)
    assert _types(init) == ["ftyp", "moov"]


def test_later_chunks_are_exactly_one_fragment(session):
    for data in session["chunks"][1:]:
        assert _types(data) == ["moof", "mdat"]
    assert _types(session["trailer"]) == ["moof", "mdat"]  # the AAC frames the encoder still held


def test_whole_stream_decodes_with_expected_counts_and_monotonic_time(session):
    data = b"".join(session["chunks"]) + session["trailer"]
    with av.open(io.BytesIO(data)) as container:
        video = list(container.decode(video=0))
    assert len(video) == session["frames"]
    times = [f.time for f in video]
    assert times == pytest.approx([i / FPS for i in range(session["frames"])])
    keyframes = [i for i, f in enumerate(video) if f.key_frame]
    assert keyframes == list(np.cumsum((0,) + CHUNKS[:-1]))
    assert video[0].width == W and video[0].height == H

    with av.open(io.BytesIO(data)) as container:
        audio = list(container.decode(audio=0))
    # The edit list removes the AAC priming, so audio starts at 0 like the video.
    assert audio[0].pts == 0 and audio[0].sample_rate == SR and audio[0].layout.nb_channels == 2
    pts = [f.pts for f in audio]
    assert all(b - a == f.samples for a, b, f in zip(pts, pts[1:], audio))
    decoded = sum(f.samples for f in audio)
    # Tolerance: the decoder does not trim the padding of the final AAC frame, so up to one frame (1024
    # samples) more than was fed; never fewer.
    assert session["samples"] <= decoded < session["samples"] + AAC_FRAME_SAMPLES
    video_end = session["frames"] / FPS
    assert abs(decoded / SR - video_end) < AAC_FRAME_SAMPLES / SR


def test_audio_content_survives(session):
    data = b"".join(session["chunks"]) + session["trailer"]
    with av.open(io.BytesIO(data)) as container:
        pcm = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1)
    # left 440 Hz, right 660 Hz: the dominant frequency per channel over a middle second
    seg = pcm[:, SR:2 * SR]
    peaks = np.abs(np.fft.rfft(seg, axis=1)).argmax(axis=1)
    assert peaks.tolist() == [440, 660]


def test_each_fragment_decodes_alone_after_the_init_segment(session):
    init = session["muxer"].init_segment
    start = 0
    for i, (n, data) in enumerate(zip(CHUNKS, session["chunks"])):
        fragment = data[len(init):] if i == 0 else data
        assert fragment[4:8] == b"moof"
        with av.open(io.BytesIO(init + fragment)) as container:
            frames = list(container.decode(video=0))
        assert len(frames) == n
        assert frames[0].key_frame
        assert frames[0].time == pytest.approx(start / FPS)  # tfdt carries the session timeline
        start += n


def test_codec_string_comes_from_the_stream(session):
    muxer = session["muxer"]
    codec = muxer.codec_string
    video, audio = codec.split(", ")
    assert audio == "mp4a.40.2"
    init = muxer.init_segment
    avcc = init[init.index(b"avcC") + 4:]
    assert video == f"avc1.{avcc[1]:02X}{avcc[2]:02X}{avcc[3]:02X}"
    assert muxer.mime_type == f'video/mp4; codecs="{codec}"'


def test_audio_remainder_carried_across_tiny_chunks():
    muxer = FragmentedMP4Muxer(W, H)
    frames = np.zeros((2, H, W, 3), np.uint8)
    out = [muxer.encode(frames, np.full((2, 700), 0.1, np.float32)) for _ in range(5)]
    out.append(muxer.close())
    assert muxer.samples_encoded == 3500
    with av.open(io.BytesIO(b"".join(out))) as container:
        audio = list(container.decode(audio=0))
    assert 3500 <= sum(f.samples for f in audio) < 3500 + AAC_FRAME_SAMPLES


@pytest.mark.parametrize("frames, audio, match", [
    (np.zeros((3, H, W, 3), np.float32), np.zeros((2, 10), np.float32), "dtype float32"),
    (np.zeros((3, H + 2, W, 3), np.uint8), np.zeros((2, 10), np.float32), "frames shape"),
    (np.zeros((3, H, W, 4), np.uint8), np.zeros((2, 10), np.float32), "frames shape"),
    (np.zeros((0, H, W, 3), np.uint8), np.zeros((2, 10), np.float32), "N>=1"),
    (np.zeros((H, W, 3), np.uint8), np.zeros((2, 10), np.float32), "frames shape"),
    (np.zeros((3, H * 3 // 2 + 1, W), np.uint8), np.zeros((2, 10), np.float32), "I420 planes"),
    ([[0]], np.zeros((2, 10), np.float32), "numpy array"),
    (np.zeros((3, H, W, 3), np.uint8), np.zeros((1, 10), np.float32), "stereo"),
    (np.zeros((3, H, W, 3), np.uint8), np.zeros((2, 10), np.int16), "dtype int16"),
    (np.zeros((3, H, W, 3), np.uint8), np.full((2, 10), np.nan, np.float32), "NaN"),
])
def test_bad_input_is_rejected_by_name(frames, audio, match):
    muxer = FragmentedMP4Muxer(W, H)
    with pytest.raises(InvalidInput, match=match):
        muxer.encode(frames, audio)
    # the session is still usable and its first good chunk still carries the init segment
    good = muxer.encode(np.zeros((2, H, W, 3), np.uint8), np.zeros((2, 100), np.float32))
    assert _types(good)[:2] == ["ftyp", "moov"]


def test_halves_encoded_in_two_threads_give_the_same_bytes(session):
    # The VAE encodes a phase's AAC in its audio thread while the H.264 is encoded in its own.
    from concurrent.futures import ThreadPoolExecutor

    muxer = FragmentedMP4Muxer(W, H, fps=FPS, sample_rate=SR)
    rng = np.random.default_rng(0)
    outputs, done = [], 0
    with ThreadPoolExecutor(1) as audio_thread:
        for n in CHUNKS:
            frames, audio = _chunk(rng, done, n)
            encoded_audio = audio_thread.submit(muxer.encode_audio, audio)
            outputs.append(muxer.emit(muxer.encode_video(frames), encoded_audio.result()))
            done += n
    assert outputs == session["chunks"] and muxer.close() == session["trailer"]
    with pytest.raises(SequenceMismatch):
        muxer.encode_audio(np.zeros((2, 10), np.float32))


def test_video_is_encoded_at_the_published_quality(session):
    # TaoMate-H3 writes its video at CRF 18, and vLLM-Omni streams it so; libx264 records its settings in the stream
    assert b"crf=18.0" in session["chunks"][0]
    assert b" bframes=0 " in session["chunks"][0]  # no B-frames: one fragment per chunk, nothing held back
    audio = av.open(io.BytesIO(b"".join(session["chunks"]) + session["trailer"])).streams.audio[0]
    assert audio.codec_context.profile == "LC"
    # AAC-LC at 192 kb/s, as TaoMate-H3 writes its audio: the esds declares the rate the encoder was set to
    assert bytes((0x40, 0x15)) + bytes(3) + struct.pack(">II", 192_000, 192_000) in session["muxer"].init_segment


def test_the_stream_declares_the_colour_matrix_its_pixels_were_converted_with(session):
    # RGB is converted to Y'CbCr with BT.601 limited range (swscale, and to_i420 on a GPU). An untagged stream leaves
    # the matrix to the player: Chrome then takes BT.709, even at 864x480, and shows (200, 40, 40) as (213, 55, 39).
    data = b"".join(session["chunks"]) + session["trailer"]
    with av.open(io.BytesIO(data)) as container:
        frame = next(container.decode(video=0))
        ctx = container.streams.video[0].codec_context
        tags = (frame.colorspace, frame.color_range, ctx.color_primaries, ctx.color_trc)
    assert tags == (6, 1, 1, 1)  # SMPTE 170M (BT.601) matrix, limited range; BT.709 primaries and transfer


@pytest.mark.e2e
def test_chromium_shows_the_colours_that_were_encoded():
    import base64
    import shutil

    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium executable (Debian package 'chromium')")
    width, height = 864, 480
    frames = np.zeros((2, height, width, 3), np.uint8)
    frames[:, :, :width // 2] = (200, 40, 40)
    frames[:, :, width // 2:] = (40, 200, 40)
    muxer = FragmentedMP4Muxer(width, height, fps=FPS, sample_rate=SR)
    data = muxer.encode(frames, np.zeros((2, _samples_for(0, 2)), np.float32)) + muxer.close()
    script = """async ([mime, data]) => {
      const ms = new MediaSource(); const v = document.getElementById('v'); v.src = URL.createObjectURL(ms);
      await new Promise(r => ms.addEventListener('sourceopen', r, {once: true}));
      const sb = ms.addSourceBuffer(mime);
      sb.appendBuffer(Uint8Array.from(atob(data), x => x.charCodeAt(0)));
      await new Promise(r => { sb.onupdateend = r; });
      ms.endOfStream();
      await new Promise(r => { if (v.readyState >= 2) r(); else v.onloadeddata = r; });
      const canvas = document.createElement('canvas'); canvas.width = v.videoWidth; canvas.height = v.videoHeight;
      const g = canvas.getContext('2d');
      const read = () => { g.drawImage(v, 0, 0);
        return [0.25, 0.75].map(x => Array.from(g.getImageData(x * canvas.width, canvas.height / 2, 1, 1).data)); };
      for (let i = 0; i < 100; i++) {  // loadeddata can come before the first frame can be drawn: wait for it
        const shown = read();
        if (shown.every(p => p[3] === 255 && p[0] + p[1] + p[2] > 0)) return shown;
        await new Promise(r => setTimeout(r, 50));
      }
      return read();
    }"""
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.set_content("<video id=v muted></video>")
            shown = page.evaluate(script, [muxer.mime_type, base64.b64encode(data).decode()])
        finally:
            browser.close()
    assert np.abs(np.array(shown)[:, :3] - [[200, 40, 40], [40, 200, 40]]).max() <= 4  # H.264 and 4:2:0 rounding


def test_i420_frames_encode_like_the_rgb_they_come_from():
    # What the VAE hands over from a GPU: planes converted by torch. They match swscale's own rgb24 -> yuv420p within
    # rounding, so the stream decodes back to the same picture as from RGB.
    import torch

    from services.vae.model import to_i420

    gen = torch.Generator().manual_seed(0)
    smooth = torch.nn.functional.interpolate(torch.rand(4, 3, H // 8, W // 8, generator=gen), size=(H, W),
                                             mode="bilinear").permute(0, 2, 3, 1)  # [4, H, W, 3] in [0, 1]
    rgb = (smooth * 255).round().to(torch.uint8)
    planes = to_i420(rgb.float() / 255).numpy()  # [4, H * 3/2, W]
    assert planes.shape == (4, H * 3 // 2, W)
    swscale = np.stack([av.VideoFrame.from_ndarray(f, format="rgb24").reformat(format="yuv420p").to_ndarray()
                        for f in rgb.numpy()]).astype(int)
    diff = np.abs(planes.astype(int) - swscale)
    assert diff[:, :H].max() <= 1 and diff[:, H:].max() <= 2 and diff.mean() < 0.2
    pictures = []
    for frames in (rgb.numpy(), planes):
        muxer = FragmentedMP4Muxer(W, H, fps=FPS, sample_rate=SR)
        data = muxer.encode(frames, np.zeros((2, _samples_for(0, 4)), np.float32)) + muxer.close()
        with av.open(io.BytesIO(data)) as container:
            pictures.append(np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]))
    assert pictures[1].shape == (4, H, W, 3)
    err = [np.abs(p.astype(int) - rgb.numpy().astype(int)).mean() for p in pictures]  # lossy H.264 both ways
    assert err[1] < 1.1 * err[0] + 0.5
    with pytest.raises(ValueError, match="even width and height"):
        to_i420(torch.zeros(1, 3, 4, 3))


@pytest.mark.parametrize("kwargs, match", [
    ({"width": 95, "height": 64}, "even"),
    ({"width": 96, "height": 0}, "height=0"),
    ({"width": 96, "height": 64, "fps": 24.5}, "fps=24.5"),
    ({"width": 96, "height": 64, "sample_rate": 96000}, "sample_rate=96000"),  # beyond the 16.16 sample entry
    ({"width": 96, "height": 64, "codec_options": {"bf": "2"}}, "bf"),
])
def test_bad_construction_is_rejected(kwargs, match):
    with pytest.raises(InvalidInput, match=match):
        FragmentedMP4Muxer(**kwargs)


def test_encode_after_close_and_double_close():
    muxer = FragmentedMP4Muxer(W, H)
    muxer.encode(np.zeros((1, H, W, 3), np.uint8), np.zeros((2, 2048), np.float32))
    assert muxer.close()
    assert muxer.close() == b""
    with pytest.raises(SequenceMismatch, match="after close"):
        muxer.encode(np.zeros((1, H, W, 3), np.uint8), np.zeros((2, 10), np.float32))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.parametrize("end", ["close", "discard"])
def test_ending_a_session_frees_its_encoders_and_their_threads(end):
    # libx264 keeps its thread pool and frame buffers until its context is freed, which PyAV does only when the
    # last reference goes: a muxer still referenced (a lingering session object) kept them
    before = _threads()
    muxer = FragmentedMP4Muxer(W, H)
    muxer.encode(np.zeros((3, H, W, 3), np.uint8), np.zeros((2, 4096), np.float32))
    assert muxer.holds_encoders and _threads() > before  # libx264's threads run while the session lasts
    getattr(muxer, end)()
    assert not muxer.holds_encoders and _threads() == before
    assert muxer.close() == b""
    with pytest.raises(SequenceMismatch, match="after close"):
        muxer.encode(np.zeros((1, H, W, 3), np.uint8), np.zeros((2, 10), np.float32))


def test_parse_boxes_rejects_partial_data(session):
    data = session["chunks"][1]
    assert parse_boxes(data)[0].offset == 0
    with pytest.raises(MuxError, match="claims"):
        parse_boxes(data[:-1])
    with pytest.raises(MuxError, match="truncated"):
        parse_boxes(data + b"\x00\x00")


@pytest.mark.e2e
def test_chromium_media_source_buffers_the_stream_contiguously(session):
    """The boxes are hand-written, so check them against a real MSE implementation too (headless Chromium)."""
    import base64
    import shutil

    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium executable (Debian package 'chromium')")
    muxer = session["muxer"]
    chunks = [base64.b64encode(c).decode() for c in (*session["chunks"], session["trailer"])]
    script = """async ([mime, chunks]) => {
      const out = {supported: MediaSource.isTypeSupported(mime), buffered: [], errors: 0};
      const ms = new MediaSource(); const v = document.getElementById('v'); v.src = URL.createObjectURL(ms);
      await new Promise(r => ms.addEventListener('sourceopen', r, {once: true}));
      const sb = ms.addSourceBuffer(mime);
      for (const c of chunks) {
        sb.appendBuffer(Uint8Array.from(atob(c), x => x.charCodeAt(0)));
        await new Promise(r => { sb.onupdateend = r; sb.onerror = () => { out.errors++; r(); }; });
        const ranges = [];
        for (let i = 0; i < sb.buffered.length; i++) ranges.push([sb.buffered.start(i), sb.buffered.end(i)]);
        out.buffered.push(ranges);
      }
      out.mediaError = v.error && v.error.message;
      return out; }"""
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.set_content("<video id=v muted></video>")
            result = page.evaluate(script, [muxer.mime_type, chunks])
        finally:
            browser.close()
    assert result["supported"] and result["errors"] == 0 and result["mediaError"] is None
    ends = []
    for ranges in result["buffered"]:
        assert len(ranges) == 1 and ranges[0][0] == pytest.approx(0, abs=1e-3)  # one range from 0: no gaps
        ends.append(ranges[0][1])
    assert ends == sorted(ends)
    assert ends[-1] == pytest.approx(session["frames"] / FPS, abs=AAC_FRAME_SAMPLES / SR)


def test_missing_libx264_fails_loudly_at_construction(monkeypatch):
    from services.vae import mux

    monkeypatch.setattr(mux.av, "codecs_available", set(av.codecs_available) - {"libx264"})
    with pytest.raises(mux.EncoderUnavailable, match="libx264"):
        FragmentedMP4Muxer(W, H)

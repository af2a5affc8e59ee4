"""Fragmented MP4 (ISO-BMFF) muxing of one streaming session: RGB frames + stereo PCM in, MSE-ready bytes out.

Knows nothing about latents, models, gRPC or websockets. Each `encode()` call is one generated chunk; it
returns whole top-level boxes only: the init segment (`ftyp` + `moov`) on the first call, then exactly one
`moof` + `mdat` fragment holding that chunk's video (which starts with an IDR frame) and the AAC frames that
are complete so far. `close()` flushes the audio encoder into a last fragment.

Why PyAV encodes but this module writes the boxes: FFmpeg's mov muxer closes a fragment only when the *next*
keyframe (or the trailer) arrives, and PyAV does not expose the `av_write_frame(ctx, NULL)` flush, so an
`av.open(..., format="mp4")` container returns every chunk one call late (checked with av 16.0.1). Here one
libx264 and one AAC encoder live for the whole session (monotonic timestamps, never restarted) and the
fragment for a chunk is written as soon as the chunk is encoded. `close()` (or `discard()`) frees both encoders:
libx264 holds a pool of threads and its frame buffers until its context is freed, which PyAV does only when the
last reference to it goes, so a muxer still referenced somewhere would otherwise keep them.

Timelines: video uses `fps * 1000` ticks per second, frame k starts at k / fps. Audio uses the sample rate;
the AAC encoder's priming samples (1024 for FFmpeg's native encoder) are kept in the media timeline and
removed by an edit list (`elst` media_time = priming), so decoded audio sample 0 plays at time 0 with video
frame 0. AAC works on 1024-sample frames, so the samples of a chunk that do not fill a frame are carried to
the next chunk; the encoder also holds one frame back, so a fragment's audio ends up to ~2048 samples
(64 ms at 32 kHz) before its video, and `close()` delivers the rest.
"""
from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from fractions import Fraction
from typing import Iterable, NamedTuple

import av
import numpy as np

from services.common.errors import InternalError, InvalidInput, SequenceMismatch

log = logging.getLogger(__name__)

VIDEO_CODEC = "libx264"
AUDIO_CODEC = "aac"
AUDIO_CHANNELS = 2
AAC_FRAME_SAMPLES = 1024
VIDEO_TRACK_ID = 1
AUDIO_TRACK_ID = 2
DEFAULT_VIDEO_OPTIONS = {
    "preset": "ultrafast",
    "tune": "zerolatency",
    "bf": "0",
    "forced-idr": "1",
    "crf": "18",  # as TaoMate-H3 writes its video and vLLM-Omni streams it
}
# Options that would make libx264 hold frames back (or add B-frames) break one-fragment-per-chunk.
_FORBIDDEN_VIDEO_OPTIONS = ("bf", "tune", "forced-idr", "rc-lookahead", "x264-params", "x264opts")

# ISO-BMFF sample flags (ISO/IEC 14496-12 8.8.3.1): sync sample vs. sample depending on others.
_SYNC_SAMPLE_FLAGS = 0x02000000
_NON_SYNC_SAMPLE_FLAGS = 0x01010000
# FFmpeg's AVColorSpace / AVColorRange / AVColorPrimaries and AVColorTransferCharacteristic codes (the H.264 VUI's).
_AVCOL_SPC_SMPTE170M = 6
_AVCOL_RANGE_MPEG = 1
_AVCOL_BT709 = 1
_UNITY_MATRIX = struct.pack(">9I", 0x00010000, 0, 0, 0, 0x00010000, 0, 0, 0, 0x40000000)


class EncoderUnavailable(InternalError):
    """The bundled FFmpeg lacks an encoder the muxer needs (libx264 or aac): the deployment's fault."""


class MuxError(InternalError):
    """The encoders produced output the muxer cannot package (a bug or an unsupported codec option)."""


class Box(NamedTuple):
    """One top-level ISO-BMFF box inside a byte string."""

    type: str
    offset: int
    size: int


def parse_boxes(data: bytes) -> list[Box]:
    """Split data into top-level boxes; raise MuxError unless it is exactly a sequence of whole boxes."""
    boxes: list[Box] = []
    pos = 0
    while pos < len(data):
        if len(data) - pos < 8:
            raise MuxError(f"truncated box header at byte {pos} of {len(data)}")
        size, kind = struct.unpack_from(">I4s", data, pos)
        header = 8
        if size == 1:
            if len(data) - pos < 16:
                raise MuxError(f"truncated 64-bit box size at byte {pos}")
            (size,) = struct.unpack_from(">Q", data, pos + 8)
            header = 16
        elif size == 0:
            size = len(data) - pos
        if size < header or pos + size > len(data):
            raise MuxError(f"box {kind!r} at byte {pos} claims {size} bytes, {len(data) - pos} remain")
        boxes.append(Box(kind.decode("latin-1"), pos, size))
        pos += size
    return boxes


# --- box writing -------------------------------------------------------------------------------------------


def _box(kind: bytes, *payload: bytes) -> bytes:
    body = b"".join(payload)
    return struct.pack(">I4s", 8 + len(body), kind) + body


def _full_box(kind: bytes, version: int, flags: int, *payload: bytes) -> bytes:
    return _box(kind, struct.pack(">I", (version << 24) | flags), *payload)


def _descriptor(tag: int, payload: bytes) -> bytes:
    if len(payload) > 127:
        raise MuxError(f"descriptor tag {tag} too long ({len(payload)} bytes)")
    return bytes((tag, len(payload))) + payload


def _split_annexb(data: bytes) -> list[bytes]:
    """NAL units of an Annex-B byte stream (3- or 4-byte start codes)."""
    units: list[bytes] = []
    starts: list[tuple[int, int]] = []  # (start code position, payload position)
    pos = data.find(b"\x00\x00\x01")
    while pos != -1:
        code_at = pos - 1 if pos > 0 and data[pos - 1] == 0 else pos
        starts.append((code_at, pos + 3))
        pos = data.find(b"\x00\x00\x01", pos + 3)
    for i, (_, begin) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(data)
        if end > begin:
            units.append(data[begin:end])
    return units


def _length_prefixed(annexb: bytes) -> bytes:
    """Rewrite an Annex-B access unit as the 4-byte length-prefixed form MP4 stores."""
    units = _split_annexb(annexb)
    if not units:
        raise MuxError("libx264 returned a packet without NAL units")
    return b"".join(struct.pack(">I", len(unit)) + unit for unit in units)


def _avcc(extradata: bytes) -> bytes:
    """AVCDecoderConfigurationRecord (ISO/IEC 14496-15 5.3.3.1) from libx264's Annex-B SPS/PPS headers."""
    units = _split_annexb(extradata)
    sps = [u for u in units if u[0] & 0x1F == 7]
    pps = [u for u in units if u[0] & 0x1F == 8]
    if len(sps) != 1 or not pps or len(sps[0]) < 4:
        raise MuxError(f"libx264 headers hold {len(sps)} SPS and {len(pps)} PPS; expected 1 and >= 1")
    profile, compat, level = sps[0][1], sps[0][2], sps[0][3]
    record = bytes((1, profile, compat, level, 0xFF, 0xE1)) + struct.pack(">H", len(sps[0])) + sps[0]
    record += bytes((len(pps),)) + b"".join(struct.pack(">H", len(p)) + p for p in pps)
    if profile in (100, 110, 122, 144):
        # High profiles carry chroma format and bit depths; yuv420p 8-bit is all this muxer emits.
        record += bytes((0xFC | 1, 0xF8, 0xF8, 0))
    return record


@dataclass(frozen=True)
class _Sample:
    """One encoded access unit as stored in a track run."""

    data: bytes
    duration: int  # in the track's timescale
    sync: bool


def _trun(samples: list[_Sample], data_offset: int, video: bool) -> bytes:
    flags = 0x000001 | 0x000100 | 0x000200 | (0x000400 if video else 0)
    entries = []
    for s in samples:
        entry = struct.pack(">II", s.duration, len(s.data))
        if video:
            entry += struct.pack(">I", _SYNC_SAMPLE_FLAGS if s.sync else _NON_SYNC_SAMPLE_FLAGS)
        entries.append(entry)
    return _full_box(b"trun", 0, flags, struct.pack(">Ii", len(samples), data_offset), *entries)


def _traf(track_id: int, base_time: int, samples: list[_Sample], data_offset: int, video: bool) -> bytes:
    # tfhd flags: 0x020000 default-base-is-moof (what MSE expects), 0x000020 default-sample-flags present.
    tfhd = _full_box(b"tfhd", 0, 0x020020, struct.pack(">II", track_id, _SYNC_SAMPLE_FLAGS))
    tfdt = _full_box(b"tfdt", 1, 0, struct.pack(">Q", base_time))
    return _box(b"traf", tfhd, tfdt, _trun(samples, data_offset, video))


def _fragment(sequence: int, tracks: list[tuple[int, int, list[_Sample], bool]]) -> bytes:
    """moof + mdat for tracks given as (track_id, base decode time, samples, is_video); empty tracks dropped."""
    tracks = [t for t in tracks if t[2]]
    mfhd = _full_box(b"mfhd", 0, 0, struct.pack(">I", sequence))
    # The trun data offsets depend on the moof size, which does not depend on their values: size it first.
    sizes = [len(_traf(tid, base, samples, 0, video)) for tid, base, samples, video in tracks]
    moof_size = 8 + len(mfhd) + sum(sizes)
    offset = moof_size + 8  # first payload byte after the mdat header, relative to the moof start
    trafs = []
    for tid, base, samples, video in tracks:
        trafs.append(_traf(tid, base, samples, offset, video))
        offset += sum(len(s.data) for s in samples)
    moof = _box(b"moof", mfhd, *trafs)
    return moof + _box(b"mdat", *(s.data for _, _, samples, _ in tracks for s in samples))


def _track(track_id: int, timescale: int, handler: bytes, name: bytes, media_header: bytes,
           sample_entry: bytes, width: int = 0, height: int = 0, edit_media_time: int = 0) -> bytes:
    volume = 0 if handler == b"vide" else 0x0100
    tkhd = _full_box(b"tkhd", 0, 0x000003, struct.pack(">IIIII", 0, 0, track_id, 0, 0), bytes(8),
                     struct.pack(">hhhH", 0, 0, volume, 0), _UNITY_MATRIX,
                     struct.pack(">II", width << 16, height << 16))
    edts = b""
    if edit_media_time:
        # One edit: play the whole (fragmented, so open-ended: duration 0) media from edit_media_time on.
        edts = _box(b"edts", _full_box(b"elst", 0, 0, struct.pack(">IIiHH", 1, 0, edit_media_time, 1, 0)))
    mdhd = _full_box(b"mdhd", 0, 0, struct.pack(">IIIIHH", 0, 0, timescale, 0, 0x55C4, 0))  # 'und'
    hdlr = _full_box(b"hdlr", 0, 0, struct.pack(">I4s", 0, handler), bytes(12), name + b"\x00")
    dinf = _box(b"dinf", _full_box(b"dref", 0, 0, struct.pack(">I", 1), _full_box(b"url ", 0, 1)))
    stbl = _box(b"stbl", _full_box(b"stsd", 0, 0, struct.pack(">I", 1), sample_entry),
                _full_box(b"stts", 0, 0, struct.pack(">I", 0)), _full_box(b"stsc", 0, 0, struct.pack(">I", 0)),
                _full_box(b"stsz", 0, 0, struct.pack(">II", 0, 0)), _full_box(b"stco", 0, 0, struct.pack(">I", 0)))
    minf = _box(b"minf", media_header, dinf, stbl)
    return _box(b"trak", tkhd, edts, _box(b"mdia", mdhd, hdlr, minf))


def _init_segment(width: int, height: int, video_timescale: int, avcc: bytes, sample_rate: int,
                  audio_config: bytes, audio_bitrate: int, priming: int) -> bytes:
    ftyp = _box(b"ftyp", b"isom", struct.pack(">I", 0x200), b"isomiso6avc1mp41")
    mvhd = _full_box(b"mvhd", 0, 0, struct.pack(">IIII", 0, 0, 1000, 0), struct.pack(">IH", 0x00010000, 0x0100),
                     bytes(10), _UNITY_MATRIX, bytes(24), struct.pack(">I", AUDIO_TRACK_ID + 1))
    avc1 = _box(b"avc1", bytes(6), struct.pack(">H", 1), bytes(16), struct.pack(">HH", width, height),
                struct.pack(">II", 0x00480000, 0x00480000), bytes(4), struct.pack(">H", 1), bytes(32),
                struct.pack(">Hh", 0x0018, -1), _box(b"avcC", avcc))
    decoder_config = _descriptor(0x04, bytes((0x40, 0x15)) + bytes(3) + struct.pack(">II", audio_bitrate, audio_bitrate)
                                 + _descriptor(0x05, audio_config))
    es = _descriptor(0x03, struct.pack(">HB", AUDIO_TRACK_ID, 0) + decoder_config + _descriptor(0x06, b"\x02"))
    mp4a = _box(b"mp4a", bytes(6), struct.pack(">H", 1), bytes(8), struct.pack(">HHHH", AUDIO_CHANNELS, 16, 0, 0),
                struct.pack(">I", sample_rate << 16), _full_box(b"esds", 0, 0, es))
    video = _track(VIDEO_TRACK_ID, video_timescale, b"vide", b"VideoHandler",
                   _full_box(b"vmhd", 0, 1, bytes(8)), avc1, width, height)
    audio = _track(AUDIO_TRACK_ID, sample_rate, b"soun", b"SoundHandler", _full_box(b"smhd", 0, 0, bytes(4)),
                   mp4a, edit_media_time=priming)
    trex = [_full_box(b"trex", 0, 0, struct.pack(">IIIII", tid, 1, 0, 0, 0)) for tid in (VIDEO_TRACK_ID, AUDIO_TRACK_ID)]
    return ftyp + _box(b"moov", mvhd, video, audio, _box(b"mvex", *trex))


# --- the muxer ---------------------------------------------------------------------------------------------


def _check_encoders() -> None:
    missing = [name for name in (VIDEO_CODEC, AUDIO_CODEC) if name not in av.codecs_available]
    if missing:
        raise EncoderUnavailable(
            f"PyAV {av.__version__} was built without encoder(s) {missing}; install the PyPI 'av' wheel, "
            "which bundles libx264 and FFmpeg's native aac")


@dataclass(frozen=True)
class EncodedTrack:
    """One track's encoded samples of a chunk (H.264 or AAC) and the media time of the first."""

    base: int
    samples: list[_Sample]


class FragmentedMP4Muxer:
    """One session's H.264 + AAC fragmented-MP4 stream; `encode()` per chunk, `close()` at the end."""

    def __init__(self, width: int, height: int, fps: int = 24, sample_rate: int = 32000,
                 codec_options: dict[str, str] | None = None) -> None:
        for name, value, low, high in (("width", width, 16, 8192), ("height", height, 16, 8192),
                                       ("fps", fps, 1, 240), ("sample_rate", sample_rate, 8000, 64000)):
            # sample_rate: the audio sample entry holds it as 16.16 fixed point, so at most 65,535 Hz
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise InvalidInput(f"{name}={value!r}: expected an int in [{low}, {high}]")
        if width % 2 or height % 2:
            raise InvalidInput(f"canvas {width}x{height}: yuv420p needs an even width and height")
        options = dict(codec_options or {})
        bad = sorted(k for k in options if k in _FORBIDDEN_VIDEO_OPTIONS)
        if bad:
            raise InvalidInput(f"codec_options {bad} cannot be overridden: the muxer needs zero-latency "
                               "x264 without B-frames and an IDR per chunk")
        _check_encoders()
        self.width, self.height, self.fps, self.sample_rate = width, height, fps, sample_rate
        self._video_ticks = 1000  # per frame; the video timescale is fps * 1000
        self._video = self._open_video({**DEFAULT_VIDEO_OPTIONS, **{k: str(v) for k, v in options.items()}})
        self._audio = self._open_audio()
        self._priming = AAC_FRAME_SAMPLES if self._audio.name == "aac" else 0
        avcc = _avcc(self._video.extradata or b"")
        self._init = _init_segment(width, height, fps * self._video_ticks, avcc, sample_rate,
                                   self._audio.extradata or b"", self._audio.bit_rate, self._priming)
        audio_object_type = (self._audio.extradata or b"\x10")[0] >> 3
        self._codec_string = f"avc1.{avcc[1]:02X}{avcc[2]:02X}{avcc[3]:02X}, mp4a.40.{audio_object_type}"
        self._sequence = 0
        self._frames_in = 0  # video frames encoded so far (next pts)
        self._samples_in = 0  # audio samples fed to the encoder so far (next pts)
        self._pending_audio = np.zeros((AUDIO_CHANNELS, 0), np.float32)  # < 1024 samples carried over
        self._audio_next_time: int | None = None  # media decode time of the next AAC packet
        self._closed = False

    def _open_video(self, options: dict[str, str]) -> av.VideoCodecContext:
        ctx = av.CodecContext.create(VIDEO_CODEC, "w")
        ctx.width, ctx.height, ctx.pix_fmt = self.width, self.height, "yuv420p"
        ctx.time_base = Fraction(1, self.fps)
        ctx.framerate = Fraction(self.fps)
        ctx.gop_size = 10 * 60 * self.fps  # chunk starts force IDRs; no periodic keyframes in between
        ctx.flags |= av.codec.context.Flags.global_header  # SPS/PPS in extradata, for avcC
        # The SPS says how to turn the pixels back into RGB: they were converted with the BT.601 matrix at limited
        # range (swscale's rgb24 -> yuv420p default, and `model.to_i420`). Untagged, Chrome takes BT.709.
        ctx.colorspace, ctx.color_range = _AVCOL_SPC_SMPTE170M, _AVCOL_RANGE_MPEG
        ctx.color_primaries = ctx.color_trc = _AVCOL_BT709  # sRGB's primaries; the usual web-video transfer
        ctx.options = options
        try:
            ctx.open()
        except av.error.FFmpegError as exc:
            raise InvalidInput(f"libx264 rejected the codec options {options}: {exc}") from exc
        return ctx

    def _open_audio(self) -> av.AudioCodecContext:
        ctx = av.CodecContext.create(AUDIO_CODEC, "w")
        ctx.sample_rate, ctx.layout, ctx.format = self.sample_rate, "stereo", "fltp"
        ctx.time_base = Fraction(1, self.sample_rate)
        ctx.bit_rate = 192_000  # AAC-LC at 192 kb/s, as TaoMate-H3 writes its audio
        ctx.flags |= av.codec.context.Flags.global_header  # AudioSpecificConfig in extradata, for esds
        ctx.open()
        if ctx.frame_size != AAC_FRAME_SAMPLES:
            raise MuxError(f"aac encoder frame size {ctx.frame_size}, expected {AAC_FRAME_SAMPLES}")
        return ctx

    @property
    def init_segment(self) -> bytes:
        """ftyp + moov: what a new viewer (or a reconnect) must append before any fragment."""
        return self._init

    @property
    def codec_string(self) -> str:
        """The MSE / RFC 6381 codecs parameter, e.g. 'avc1.42C01E, mp4a.40.2', derived from the init segment."""
        return self._codec_string

    @property
    def mime_type(self) -> str:
        """`video/mp4; codecs="..."` for MediaSource.isTypeSupported / addSourceBuffer."""
        return f'video/mp4; codecs="{self.codec_string}"'

    @property
    def holds_encoders(self) -> bool:
        """The session's libx264 and AAC encoders are still allocated (until `close()` or `discard()`)."""
        return self._video is not None

    @property
    def frames_encoded(self) -> int:
        """Video frames muxed so far in this session."""
        return self._frames_in

    @property
    def samples_encoded(self) -> int:
        """Audio samples (per channel) accepted so far in this session."""
        return self._samples_in + self._pending_audio.shape[1]

    def encode(self, frames: np.ndarray, audio: np.ndarray) -> bytes:
        """Encode one chunk; returns (init segment on the first call +) exactly this chunk's fragment."""
        # frames: [N, H, W, 3] uint8 RGB, or [N, H * 3/2, W] uint8 I420 planes (BT.601 limited range, as swscale
        # would convert the RGB); audio: [2, S] float32 in [-1, 1]
        self._check_open()
        self._check_frames(frames)  # both checked before either encoder advances
        self._check_audio(audio)
        return self.emit(self._video_track(frames), self._encode_audio(audio, final=False))

    def encode_audio(self, audio: np.ndarray) -> EncodedTrack:
        """The AAC half of a chunk (`encode` = `emit(encode_video(...), encode_audio(...))`). The two halves touch
        separate encoders, and PyAV releases the GIL while FFmpeg encodes, so they may run in two threads."""
        # audio: [2, S] float32 in [-1, 1]
        self._check_open()
        self._check_audio(audio)
        return self._encode_audio(audio, final=False)

    def encode_video(self, frames: np.ndarray) -> EncodedTrack:
        """The H.264 half of a chunk: RGB `[N, H, W, 3]` or I420 planes `[N, H * 3/2, W]`, uint8."""
        self._check_open()
        self._check_frames(frames)
        return self._video_track(frames)

    def emit(self, video: EncodedTrack, audio: EncodedTrack) -> bytes:
        """One chunk's fragment from its two halves (the init segment before the first)."""
        self._check_open()
        first = self._sequence == 0
        out = self._emit(video, audio)
        return self._init + out if first else out

    def _video_track(self, frames: np.ndarray) -> EncodedTrack:
        samples = self._encode_video(frames)
        return EncodedTrack((self._frames_in - len(samples)) * self._video_ticks, samples)

    def _check_open(self) -> None:
        if self._closed:
            raise SequenceMismatch("encode() after close(): the muxer's session has ended")

    def close(self) -> bytes:
        """Flush both encoders and free them; returns the last fragment (b'' if nothing is left or already closed)."""
        if self._closed:
            return b""
        self._closed = True
        try:
            if self._sequence == 0:
                return b""  # nothing was ever sent: no init segment, no trailer
            leftover = self._video.encode(None)
            if leftover:
                raise MuxError(f"libx264 flushed {len(leftover)} held-back frame(s); zero-latency settings expected")
            audio = self._encode_audio(np.zeros((AUDIO_CHANNELS, 0), np.float32), final=True)
            return self._emit(EncodedTrack(0, []), audio) if audio.samples else b""
        finally:
            self.discard()

    def discard(self) -> None:
        """End the session without its last fragment: free both encoders now (their threads and buffers)."""
        self._closed = True
        self._video = self._audio = None

    def _emit(self, video: EncodedTrack, audio: EncodedTrack) -> bytes:
        self._sequence += 1
        out = _fragment(self._sequence, [(VIDEO_TRACK_ID, video.base, video.samples, True),
                                         (AUDIO_TRACK_ID, audio.base, audio.samples, False)])
        parse_boxes(out)  # whole boxes only, by construction; a failure here is a muxer bug
        return out

    def _check_frames(self, frames: np.ndarray) -> None:
        if not isinstance(frames, np.ndarray):
            raise InvalidInput(f"frames must be a numpy array, got {type(frames).__name__}")
        if frames.dtype != np.uint8:
            raise InvalidInput(f"frames dtype {frames.dtype}: expected uint8 RGB or I420")
        rgb, i420 = (self.height, self.width, 3), (self.height * 3 // 2, self.width)
        if frames.shape[1:] not in (rgb, i420) or frames.shape[0] < 1:
            raise InvalidInput(f"frames shape {frames.shape}: expected RGB [N>=1, {rgb[0]}, {rgb[1]}, 3] or I420 "
                               f"planes [N>=1, {i420[0]}, {i420[1]}]")

    def _check_audio(self, audio: np.ndarray) -> None:
        if not isinstance(audio, np.ndarray):
            raise InvalidInput(f"audio must be a numpy array, got {type(audio).__name__}")
        if audio.dtype != np.float32:
            raise InvalidInput(f"audio dtype {audio.dtype}: expected float32")
        if audio.ndim != 2 or audio.shape[0] != AUDIO_CHANNELS:
            raise InvalidInput(f"audio shape {audio.shape}: expected [{AUDIO_CHANNELS}, samples] (stereo)")
        if not np.isfinite(audio).all():
            raise InvalidInput("audio contains NaN or infinite samples")

    def _encode_video(self, frames: np.ndarray) -> list[_Sample]:
        # frames: [N, H, W, 3] RGB or [N, H * 3/2, W] I420
        packets = []
        for i in range(frames.shape[0]):
            if frames.ndim == 3:
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frames[i]), format="yuv420p")
            else:
                rgb = av.VideoFrame.from_ndarray(np.ascontiguousarray(frames[i]), format="rgb24")
                frame = rgb.reformat(format="yuv420p")
            frame.pts = self._frames_in + i
            frame.pict_type = av.video.frame.PictureType.I if i == 0 else av.video.frame.PictureType.NONE
            packets.extend(self._video.encode(frame))
        self._frames_in += frames.shape[0]
        if len(packets) != frames.shape[0] or not packets[0].is_keyframe:
            raise MuxError(f"libx264 returned {len(packets)} packet(s) for {frames.shape[0]} frame(s) "
                           f"(first keyframe: {bool(packets) and packets[0].is_keyframe}); zero latency expected")
        return [_Sample(_length_prefixed(bytes(p)), self._video_ticks, p.is_keyframe) for p in packets]

    def _encode_audio(self, audio: np.ndarray, final: bool) -> EncodedTrack:
        # audio: [2, S]; pending + audio is cut into 1024-sample frames, the remainder waits (or, if final, goes)
        pcm = np.concatenate([self._pending_audio, audio], axis=1)
        usable = pcm.shape[1] if final else pcm.shape[1] - pcm.shape[1] % AAC_FRAME_SAMPLES
        packets = []
        for start in range(0, usable, AAC_FRAME_SAMPLES):
            block = np.ascontiguousarray(pcm[:, start:start + AAC_FRAME_SAMPLES])
            frame = av.AudioFrame.from_ndarray(block, format="fltp", layout="stereo")
            frame.sample_rate = self.sample_rate
            frame.pts = self._samples_in + start
            packets.extend(self._audio.encode(frame))
        self._samples_in += usable
        self._pending_audio = pcm[:, usable:]
        if final:
            packets.extend(self._audio.encode(None))
        return self._audio_samples(packets)

    def _audio_samples(self, packets: Iterable[av.Packet]) -> EncodedTrack:
        samples: list[_Sample] = []
        base = self._audio_next_time if self._audio_next_time is not None else 0
        for p in packets:
            media_time = p.pts + self._priming  # the priming packet (pts -1024) sits at media time 0
            if self._audio_next_time is None:
                self._audio_next_time = base = media_time
            if media_time != self._audio_next_time:
                raise MuxError(f"aac packet at media time {media_time}, expected {self._audio_next_time}")
            duration = p.duration or AAC_FRAME_SAMPLES
            samples.append(_Sample(bytes(p), duration, True))
            self._audio_next_time += duration
        return EncodedTrack(base, samples)

// Plays an fMP4 stream (an init segment, then moof+mdat fragments) through Media Source Extensions.
// Shared by the director's page (app.js) and the viewer's page (watch.js); knows nothing about websockets.
"use strict";

const KEEP_BEHIND_S = 10;   // seconds of played media kept in the SourceBuffer
const TRIM_AFTER_S = 30;    // trim once this much played media is buffered
const MAX_LIVE_LAG_S = 6;   // jump forward when playback falls this far behind the live edge

// RFC 6381 codecs string from the init segment: avcC holds profile, compatibility and level bytes.
function codecsFromInit(bytes) {
  const find = (a, b, c, d) => {
    for (let i = 0; i + 3 < bytes.length; i++) {
      if (bytes[i] === a && bytes[i + 1] === b && bytes[i + 2] === c && bytes[i + 3] === d) return i;
    }
    return -1;
  };
  const hex = (v) => v.toString(16).toUpperCase().padStart(2, "0");
  const avcc = find(0x61, 0x76, 0x63, 0x43); // "avcC"
  let video = "avc1.42E01E";
  if (avcc >= 0 && avcc + 7 < bytes.length) {
    video = "avc1." + hex(bytes[avcc + 5]) + hex(bytes[avcc + 6]) + hex(bytes[avcc + 7]);
  }
  const hasAudio = find(0x6d, 0x70, 0x34, 0x61) >= 0; // "mp4a"
  return hasAudio ? `${video}, mp4a.40.2` : video;
}

// One stream into one <video>: append() the init segment first, then the fragments; end() after the last.
// A stream may start late (a viewer joins mid-session) or skip ahead (a slow viewer): playback jumps over the gap.
class MsePlayer {
  constructor(video, onError) {
    this.video = video;
    this.onError = onError;
    this.queue = [];
    this.mediaSource = null;
    this.sourceBuffer = null;
    this.ended = false;
  }

  append(bytes) {
    if (!this.mediaSource) this.open(bytes);
    this.queue.push(bytes);
    this.pump();
  }

  end() {
    this.ended = true;
    this.pump();
  }

  reset() {
    this.queue = [];
    this.mediaSource = null;
    this.sourceBuffer = null;
    this.ended = false;
    this.video.removeAttribute("src");
  }

  open(initBytes) {
    const mime = `video/mp4; codecs="${codecsFromInit(initBytes)}"`;
    if (!window.MediaSource || !MediaSource.isTypeSupported(mime)) {
      this.onError(`this browser cannot play ${mime}`);
      return;
    }
    const mediaSource = new MediaSource();
    this.mediaSource = mediaSource;
    this.video.src = URL.createObjectURL(mediaSource);
    mediaSource.addEventListener("sourceopen", () => {
      if (this.mediaSource !== mediaSource) return;  // reset meanwhile
      this.sourceBuffer = mediaSource.addSourceBuffer(mime);
      this.sourceBuffer.mode = "segments";
      this.sourceBuffer.addEventListener("updateend", () => this.onUpdateEnd());
      this.pump();
    }, { once: true });
  }

  pump() {
    const buffer = this.sourceBuffer;
    if (!buffer || buffer.updating) return;
    if (this.queue.length > 0) {
      try {
        buffer.appendBuffer(this.queue.shift());
      } catch (err) {
        this.onError(`playback error: ${err.message}`);
      }
      return;
    }
    if (this.ended && this.mediaSource.readyState === "open") this.mediaSource.endOfStream();
  }

  onUpdateEnd() {
    const video = this.video;
    const ranges = this.sourceBuffer.buffered;
    if (ranges.length > 0) {
      this.skipGap(ranges);  // first: a late start is a gap, not a lag
      const end = ranges.end(ranges.length - 1);
      if (end - video.currentTime > MAX_LIVE_LAG_S) video.currentTime = end - 1;
      const start = ranges.start(0);
      if (video.currentTime - start > TRIM_AFTER_S && this.queue.length === 0) {
        this.sourceBuffer.remove(start, video.currentTime - KEEP_BEHIND_S);
        return;
      }
    }
    if (video.paused && ranges.length > 0) video.play().catch(() => {});
    this.pump();
  }

  // Playback outside every buffered range (a late start, or chunks skipped): move to the next range's start.
  skipGap(ranges) {
    const now = this.video.currentTime;
    for (let i = 0; i < ranges.length; i++) {
      if (now >= ranges.start(i) && now < ranges.end(i)) return;
      if (ranges.start(i) > now) {
        this.video.currentTime = ranges.start(i);
        return;
      }
    }
  }
}

// vitascope LL-HLS playback: one session's playlist (/v1/realtime/video/hls/{id}/playlist.m3u8) in a <video>, with
// hls.js (static/vendor/hls.min.js, loaded before this file) where MSE is available, else the browser's own HLS.
// `playHls(video, sessionId, token, onEvent)` is what a page calls; watch_hls.html calls it for ?session=&token=.
// A token given here is sent as ?token= on the playlist; the gateway then writes it into every URI it lists.
"use strict";

function hlsPlaylistUrl(sessionId, token) {
  let url = `/v1/realtime/video/hls/${encodeURIComponent(sessionId)}/playlist.m3u8`;
  if (token) url += `?token=${encodeURIComponent(token)}`;
  return url;
}

// onEvent(kind, detail): "playing", "part" ({sn, part, duration}), "ended", "error" ({message, fatal}).
// Returns {stop(), stats()}: stats() gives the parts loaded, the live latency and hls.js's target for it.
function playHls(video, sessionId, token, onEvent) {
  const url = hlsPlaylistUrl(sessionId, token);
  const counts = { parts: 0, segments: 0 };
  const notify = (kind, detail) => { if (onEvent) onEvent(kind, detail || {}); };
  video.addEventListener("playing", () => notify("playing"), { once: true });
  video.addEventListener("ended", () => notify("ended"));
  if (!(window.Hls && Hls.isSupported())) {
    if (video.canPlayType("application/vnd.apple.mpegurl")) {  // Safari plays LL-HLS itself
      video.src = url;
      video.play().catch(() => {});
      return { stop() { video.removeAttribute("src"); video.load(); }, stats: () => ({ native: true }) };
    }
    notify("error", { message: "this browser plays neither MSE nor HLS", fatal: true });
    return { stop() {}, stats: () => ({}) };
  }
  const hls = new Hls({ lowLatencyMode: true, backBufferLength: 30 });
  hls.on(Hls.Events.FRAG_LOADED, (_event, data) => {
    if (data.part) {
      counts.parts += 1;
      notify("part", { sn: data.frag.sn, part: data.part.index, duration: data.part.duration });
    } else {
      counts.segments += 1;
    }
  });
  hls.on(Hls.Events.ERROR, (_event, data) => {
    notify("error", { message: `${data.type}: ${data.details}`, fatal: data.fatal });
    if (data.fatal && data.type === Hls.ErrorTypes.MEDIA_ERROR) hls.recoverMediaError();
  });
  hls.loadSource(url);
  hls.attachMedia(video);
  hls.on(Hls.Events.MANIFEST_PARSED, () => { video.play().catch(() => {}); });
  return {
    stop() { hls.destroy(); },
    stats() {
      return { parts: counts.parts, segments: counts.segments, latency: hls.latency,
               targetLatency: hls.targetLatency, lowLatency: hls.lowLatencyMode };
    },
  };
}

// The stand-alone page (watch_hls.html): ?session=<id>[&token=<viewer token>].
if (document.body && document.body.dataset.page === "watch-hls") {
  const params = new URLSearchParams(location.search);
  const status = document.getElementById("status");
  const setState = (text, state) => {
    status.textContent = text;
    document.body.dataset.state = state;
  };
  const session = params.get("session");
  if (!session) {
    setState("no ?session= in the address", "error");
  } else {
    document.getElementById("session").textContent = session;
    setState("loading the playlist", "loading");
    const player = playHls(document.getElementById("player"), session, params.get("token"), (kind, detail) => {
      if (kind === "playing") setState("playing", "playing");
      else if (kind === "ended") setState("the session ended", "ended");
      else if (kind === "error" && detail.fatal) setState(`error: ${detail.message}`, "error");
      else if (kind === "part") document.body.dataset.parts = String(player.stats().parts);
    });
    window.vitascopeHls = player;  // for the tests and the console
  }
}

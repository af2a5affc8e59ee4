// vitascope viewer page: plays one session's watch websocket (/v1/realtime/video/watch/{id}) with MSE.
// The page's own path is /watch/{id}; a ?token= in its URL is passed on to the websocket (a viewer token).
"use strict";

const $ = (id) => document.getElementById(id);
const PING_INTERVAL_MS = 10000;

const player = new MsePlayer($("player"), (text) => setStatus(text, "error", true));
let pendingMeta = null;
let pendingInit = false;
let lastIndex = null;
let received = 0;
let skipped = 0;

function setStatus(text, state, isError) {
  const el = $("status");
  el.textContent = text;
  el.classList.toggle("error", Boolean(isError));
  if (state) document.body.dataset.state = state;
}

function onMessage(msg) {
  switch (msg.type) {
    case "video.start":
      $("session").textContent = msg.request_id;
      $("prompt").textContent = msg.config.prompt;
      setStatus(`waiting for the stream (${msg.config.width}x${msg.config.height})`, "joined");
      break;
    case "video.init_segment":
      pendingInit = true;
      pendingMeta = msg;
      break;
    case "video.chunk_metadata":
      pendingMeta = msg;
      if (lastIndex === null) {
        $("joined").textContent = String(msg.transport_chunk_index);
        document.body.dataset.firstChunk = String(msg.transport_chunk_index);
      } else if (msg.transport_chunk_index > lastIndex + 1) {
        skipped += msg.transport_chunk_index - lastIndex - 1;  // this viewer fell behind and skipped ahead
        $("skipped").textContent = String(skipped);
      }
      lastIndex = msg.transport_chunk_index;
      if (msg.kind === "media") setStatus(`watching: chunk ${msg.transport_chunk_index}`, "watching");
      break;
    case "session.done":
      player.end();
      setStatus(`the session ended: ${msg.chunks} chunks watched${msg.stopped ? " (stopped)" : ""}`, "done");
      break;
    case "error":
      setStatus(`error ${msg.code}: ${msg.message}`, "error", true);
      break;
    default:
      break;
  }
}

function onBinary(buffer) {
  const bytes = new Uint8Array(buffer);
  if (!pendingMeta || pendingMeta.byte_length !== bytes.length) {
    setStatus("protocol error: binary frame without matching metadata", "error", true);
  }
  if (!pendingInit) {
    received += 1;
    $("received").textContent = String(received);
  }
  pendingInit = false;
  pendingMeta = null;
  player.append(bytes);
}

// The same session over LL-HLS: the hls.js page, and the playlist itself for outside players.
function showHlsLinks(id, token) {
  const query = token ? `&token=${encodeURIComponent(token)}` : "";
  $("hls-page").href = `/static/watch_hls.html?session=${encodeURIComponent(id)}${query}`;
  const playlist = `${location.origin}/v1/realtime/video/hls/${encodeURIComponent(id)}/playlist.m3u8`;
  $("hls-playlist").href = token ? `${playlist}?token=${encodeURIComponent(token)}` : playlist;
}

function watch() {
  const id = decodeURIComponent(location.pathname.split("/").filter(Boolean).pop() || "");
  const token = new URLSearchParams(location.search).get("token");
  showHlsLinks(id, token);
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  let url = `${scheme}://${location.host}/v1/realtime/video/watch/${encodeURIComponent(id)}`;
  if (token) url += `?token=${encodeURIComponent(token)}`;
  const ws = new WebSocket(url);
  ws.binaryType = "arraybuffer";
  setStatus("connecting", "connecting");
  let pingTimer = null;
  ws.onopen = () => {
    pingTimer = setInterval(() => ws.send(JSON.stringify({ type: "session.ping" })), PING_INTERVAL_MS);
  };
  ws.onmessage = (event) => {
    if (typeof event.data === "string") onMessage(JSON.parse(event.data));
    else onBinary(event.data);
  };
  ws.onclose = () => {
    clearInterval(pingTimer);
    const state = document.body.dataset.state;
    if (state !== "done" && state !== "error") {
      setStatus(state === "connecting" ? "no live session here (ended, or a wrong link or token)"
        : "connection closed", "closed", state === "connecting");
    }
  };
}

watch();

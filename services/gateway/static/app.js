// vitascope browser client: drives /v1/realtime/video and plays the fMP4 stream with Media Source Extensions.
"use strict";

const $ = (id) => document.getElementById(id);
const PING_INTERVAL_MS = 10000;
const KEEP_BEHIND_S = 10;   // seconds of played media kept in the SourceBuffer
const TRIM_AFTER_S = 30;    // trim once this much played media is buffered
const MAX_LIVE_LAG_S = 6;   // jump forward when playback falls this far behind the live edge

let ws = null;
let pingTimer = null;
let mediaSource = null;
let sourceBuffer = null;
let appendQueue = [];
let pendingMeta = null;
let requestId = null;
let startedAt = 0;
let lastChunkAt = 0;
let chunkCount = 0;
let updateCount = 0;
let streamDone = false;

function setStatus(text, state, isError) {
  const el = $("status");
  el.textContent = text;
  el.classList.toggle("error", Boolean(isError));
  if (state) document.body.dataset.state = state;
}

function setRunning(running) {
  $("start").disabled = running;
  $("stop").disabled = !running;
  $("update").disabled = !running;
}

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

function setupMediaSource(initBytes) {
  const mime = `video/mp4; codecs="${codecsFromInit(initBytes)}"`;
  if (!window.MediaSource || !MediaSource.isTypeSupported(mime)) {
    setStatus(`this browser cannot play ${mime}`, "error", true);
    return;
  }
  mediaSource = new MediaSource();
  const video = $("player");
  video.src = URL.createObjectURL(mediaSource);
  mediaSource.addEventListener("sourceopen", () => {
    sourceBuffer = mediaSource.addSourceBuffer(mime);
    sourceBuffer.mode = "segments";
    sourceBuffer.addEventListener("updateend", onUpdateEnd);
    pumpAppends();
  }, { once: true });
}

function pumpAppends() {
  if (!sourceBuffer || sourceBuffer.updating) return;
  if (appendQueue.length > 0) {
    try {
      sourceBuffer.appendBuffer(appendQueue.shift());
    } catch (err) {
      setStatus(`playback error: ${err.message}`, "error", true);
    }
    return;
  }
  if (streamDone && mediaSource && mediaSource.readyState === "open") mediaSource.endOfStream();
}

function onUpdateEnd() {
  const video = $("player");
  const ranges = sourceBuffer.buffered;
  if (ranges.length > 0) {
    const end = ranges.end(ranges.length - 1);
    if (end - video.currentTime > MAX_LIVE_LAG_S) video.currentTime = end - 1;
    const start = ranges.start(0);
    if (video.currentTime - start > TRIM_AFTER_S && appendQueue.length === 0) {
      sourceBuffer.remove(start, video.currentTime - KEEP_BEHIND_S);
      return;
    }
  }
  if (video.paused && ranges.length > 0) video.play().catch(() => {});
  pumpAppends();
}

function onBinary(buffer) {
  const bytes = new Uint8Array(buffer);
  if (!pendingMeta || pendingMeta.byte_length !== bytes.length) {
    setStatus("protocol error: binary frame without matching metadata", "error", true);
  }
  if (!mediaSource) setupMediaSource(bytes);
  appendQueue.push(bytes);
  pendingMeta = null;
  pumpAppends();
}

function addChunkRow(meta) {
  const now = performance.now();
  const latency = now - (chunkCount === 0 ? startedAt : lastChunkAt);
  lastChunkAt = now;
  const server = meta.timings ? Object.values(meta.timings).reduce((a, b) => a + b, 0) * 1000 : 0;
  const row = document.createElement("tr");
  row.dataset.index = String(meta.transport_chunk_index);
  const cells = [meta.transport_chunk_index, `${meta.request_index}/${meta.phase_index}`,
    meta.num_frames, (meta.byte_length / 1024).toFixed(1), latency.toFixed(0), server.toFixed(0)];
  for (const value of cells) {
    const td = document.createElement("td");
    td.textContent = String(value);
    row.appendChild(td);
  }
  const body = $("chunks").querySelector("tbody");
  body.insertBefore(row, body.firstChild);
  while (body.children.length > 50) body.removeChild(body.lastChild);
  chunkCount += 1;
  $("summary").textContent = `${chunkCount} received, last ${latency.toFixed(0)} ms`;
}

function markUpdate(eventId, cls, text) {
  const item = document.querySelector(`#updates li[data-event-id="${CSS.escape(eventId)}"]`);
  if (!item) return;
  item.className = cls;
  item.querySelector(".state").textContent = text;
}

function onMessage(msg) {
  switch (msg.type) {
    case "video.start":
      requestId = msg.request_id;
      setStatus(`started ${msg.config.width}x${msg.config.height}`, "started");
      break;
    case "session.queued":
      $("queue").hidden = false;
      $("queue-position").textContent = String(msg.position);
      setStatus(`waiting in queue (position ${msg.position})`, "queued");
      break;
    case "video.chunk_metadata":
      $("queue").hidden = true;
      pendingMeta = msg;
      if (msg.kind === "media") {
        addChunkRow(msg);
        setStatus(`streaming: chunk ${msg.transport_chunk_index}`, "streaming");
      }
      for (const id of msg.completed_event_ids) markUpdate(id, "applied", `applied at chunk ${msg.transport_chunk_index}`);
      break;
    case "session.interaction.queued":
      markUpdate(msg.event_id, "queued", "queued");
      break;
    case "session.done":
      $("queue").hidden = true;
      streamDone = true;
      pumpAppends();
      setStatus(`done: ${msg.chunks} chunks${msg.stopped ? " (stopped)" : ""}`, "done");
      break;
    case "error":
      if (!msg.event_id) $("queue").hidden = true;
      if (msg.event_id) markUpdate(msg.event_id, "failed", `${msg.code}: ${msg.message}`);
      setStatus(`error ${msg.code}: ${msg.message}`, msg.event_id ? null : "error", true);
      break;
    default:
      break;
  }
}

function resetPlayer() {
  appendQueue = [];
  pendingMeta = null;
  sourceBuffer = null;
  mediaSource = null;
  streamDone = false;
  chunkCount = 0;
  $("queue").hidden = true;
  $("player").removeAttribute("src");
  $("chunks").querySelector("tbody").replaceChildren();
  $("updates").replaceChildren();
  $("summary").textContent = "";
}

function start() {
  const prompt = $("prompt").value.trim();
  if (!prompt) {
    setStatus("enter a prompt first", "idle", true);
    return;
  }
  resetPlayer();
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  ws = new WebSocket(`${scheme}://${location.host}/v1/realtime/video`);
  ws.binaryType = "arraybuffer";
  setStatus("connecting", "connecting");
  setRunning(true);
  ws.onopen = () => {
    const body = { type: "session.start", prompt, format: "m4s", extra_params: {} };
    if ($("pace").checked) body.extra_params.pace_to_media_time = true;
    if ($("hold").checked) body.extra_params.hold_for_prompt = true;
    if ($("seed").value !== "") body.seed = Number($("seed").value);
    startedAt = performance.now();
    ws.send(JSON.stringify(body));
    pingTimer = setInterval(() => ws.send(JSON.stringify({ type: "session.ping" })), PING_INTERVAL_MS);
  };
  ws.onmessage = (event) => {
    if (typeof event.data === "string") onMessage(JSON.parse(event.data));
    else onBinary(event.data);
  };
  ws.onclose = () => {
    clearInterval(pingTimer);
    setRunning(false);
    $("queue").hidden = true;
    const state = document.body.dataset.state;  // done and error already say how the session ended
    if (state !== "done" && state !== "error") setStatus("connection closed", "closed");
  };
}

function stop() {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "session.stop" }));
}

function sendUpdate() {
  const prompt = $("update-prompt").value.trim();
  if (!prompt || !ws || ws.readyState !== WebSocket.OPEN) return;
  updateCount += 1;
  const eventId = `ui-${Date.now()}-${updateCount}`;
  const item = document.createElement("li");
  item.dataset.eventId = eventId;
  item.className = "sent";
  const text = document.createElement("span");
  text.textContent = `${prompt} — `;
  const state = document.createElement("span");
  state.className = "state";
  state.textContent = "sent";
  item.append(text, state);
  $("updates").appendChild(item);
  ws.send(JSON.stringify({ type: "session.interaction", interaction: { event_id: eventId, event: { prompt } } }));
}

$("start").addEventListener("click", start);
$("stop").addEventListener("click", stop);
$("update").addEventListener("click", sendUpdate);

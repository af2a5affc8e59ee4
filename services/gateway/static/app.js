// vitascope browser client: drives /v1/realtime/video and plays the fMP4 stream with Media Source Extensions.
"use strict";

const $ = (id) => document.getElementById(id);
const PING_INTERVAL_MS = 10000;
let ws = null;
let pingTimer = null;
const player = new MsePlayer($("player"), (text) => setStatus(text, "error", true));
let pendingMeta = null;
let requestId = null;
let startedAt = 0;
let lastChunkAt = 0;
let chunkCount = 0;
let updateCount = 0;

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

function onBinary(buffer) {
  const bytes = new Uint8Array(buffer);
  if (!pendingMeta || pendingMeta.byte_length !== bytes.length) {
    setStatus("protocol error: binary frame without matching metadata", "error", true);
  }
  player.append(bytes);
  pendingMeta = null;
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
      if (msg.watch_url) showShareLink(msg.request_id);
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
      player.end();
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

// The viewers' page of this session (it plays the session's watch websocket).
function showShareLink(id) {
  const link = $("share-link");
  link.href = `${location.origin}/watch/${encodeURIComponent(id)}`;
  link.textContent = link.href;
  $("share").hidden = false;
}

function resetPlayer() {
  player.reset();
  pendingMeta = null;
  chunkCount = 0;
  $("queue").hidden = true;
  $("share").hidden = true;
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

// The page: pick a source (microphone, a file, a bundled sample) and a chunk mode, stream it over
// the WebSocket as float32 PCM, show the partial apart from the finals, each final's latency, and
// the server's free slots (polled from /readyz). Audio sources live in sources.js.
"use strict";

const $ = (id) => document.getElementById(id);
const query = new URLSearchParams(location.search);
const token = query.get("token"); // browsers cannot set WebSocket headers: the token rides in the URL
const SLOT_POLL_MS = 1000;

// For tests and curious users: everything the page received, and each final's latency.
const page = (window.nemoServe = { state: "idle", messages: [], finals: [], latencies_ms: [], samples: [] });

let ws = null;
let source = null; // { sampleRate, start(), finish(), close() } from sources.js
let gotReady = false;
let nextSample = 0;
// The current segment's text as a list of code points: a partial of a long segment carries it
// from `text_offset` (code points) on; what came before stays (docs/protocol.md).
let segmentText = [];
// [audio seconds sent so far, when] after each block: a final's latency is measured from the
// moment the audio it covers (up to `audio_processed`) had been sent.
let sentLog = [];
let sentSamples = 0;

function setState(state, text, isError = false) {
  page.state = state;
  document.body.dataset.state = state;
  $("status").textContent = text || state;
  $("status").className = isError ? "error" : "";
  const idle = ["idle", "done", "error"].includes(state);
  for (const id of ["start", "sample", "file", "mode", "language"]) $(id).disabled = !idle;
  $("file").parentElement.classList.toggle("disabled", !idle); // the visible control is its label
  $("stop").disabled = state !== "streaming";
}

async function readyz() {
  try {
    return await (await fetch("/readyz")).json(); // 503 when full still carries the body
  } catch (e) {
    return null;
  }
}

function showSlots(info) {
  $("slots").textContent = info
    ? `${info.free_slots}/${info.total_slots} slots free` + (info.draining ? " - draining" : "")
    : "server unreachable";
  $("slots").dataset.free = info ? info.free_slots : "";
}

async function loadInfo() {
  const info = await readyz();
  showSlots(info);
  if (!info) return null;
  $("info").textContent = info.model;
  const modes = info.modes && info.modes.length ? info.modes : [{ context_right: info.context_right, chunk_ms: info.chunk_ms }];
  $("mode").innerHTML = modes.map((m) => `<option value="${m.context_right}">${m.chunk_ms} ms</option>`).join("");
  if (info.languages) {
    $("language").innerHTML = info.languages.map((l) => `<option>${l}</option>`).join("");
    $("language-box").hidden = false;
  }
  return info;
}

async function pollSlots() {
  showSlots(await readyz());
  setTimeout(pollSlots, SLOT_POLL_MS);
}

async function loadSamples() {
  try {
    const text = await (await fetch("/samples/manifest.jsonl")).text();
    page.samples = text.split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l));
  } catch (e) {
    page.samples = [];
  }
  $("sample").hidden = page.samples.length === 0;
}

function wsUrl() {
  const u = new URL("/ws", location.href);
  u.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  if (token) u.searchParams.set("token", token);
  return u.toString();
}

function sendBlock(samples) {
  if (!ws || ws.readyState !== WebSocket.OPEN || !samples.length) return;
  ws.send(new Float32Array(samples).buffer); // a copy: `samples` may be a view into a larger buffer
  sentSamples += samples.length;
  sentLog.push([sentSamples / source.sampleRate, performance.now()]);
}

function endInput() {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "end" }));
}

function latencyMs(audioSeconds) {
  const hit = sentLog.find(([s]) => s >= audioSeconds - 1e-3) || sentLog[sentLog.length - 1];
  return hit ? Math.max(0, Math.round(performance.now() - hit[1])) : null;
}

function showFinal(msg) {
  const latency = latencyMs(msg.audio_processed);
  page.finals.push(msg.text);
  page.latencies_ms.push(latency);
  const p = document.createElement("p");
  const at = document.createElement("span");
  at.className = "t";
  at.textContent = `${msg.start_time.toFixed(1)} s`;
  const lat = document.createElement("span");
  lat.className = "latency";
  lat.textContent = latency === null ? "" : `latency ${latency} ms`;
  lat.title = "from sending the audio this final covers to receiving it";
  p.append(at, document.createTextNode(msg.text), lat);
  $("finals").append(p);
}

function onMessage(event) {
  const msg = JSON.parse(event.data);
  page.messages.push(msg);
  if (msg.type === "ready") {
    gotReady = true;
    setState("streaming", `streaming, chunk ${msg.chunk_ms} ms`);
    source.start();
  } else if (msg.type === "partial") {
    segmentText = segmentText.slice(0, msg.text_offset || 0).concat(Array.from(msg.text));
    $("partial").textContent = segmentText.join("");
  } else if (msg.type === "final") {
    segmentText = [];
    $("partial").textContent = "";
    if (msg.text) showFinal(msg);
  } else if (msg.type === "error") {
    setState("error", `error: ${msg.reason}`, true);
  } else if (msg.type === "done") {
    setState("done", `done (${msg.audio_processed.toFixed(1)} s of audio)`);
  }
}

async function onClose(event) {
  if (source) source.close();
  source = null;
  if (page.state === "error" || page.state === "done") return;
  if (!gotReady) {
    // Refused at the handshake (HTTP 503/401): the browser hides the reason, /readyz tells it.
    const info = await readyz();
    let why = `connection refused (code ${event.code})`;
    if (info && info.draining) why = "server is shutting down";
    else if (info && info.free_slots === 0) why = "server busy: no free slot, try again later";
    else if (info && info.auth && !token) why = "this server needs ?token=... in the page URL";
    setState("error", why, true);
  } else {
    setState("error", `connection closed (code ${event.code}${event.reason ? ": " + event.reason : ""})`, true);
  }
}

function clearTranscript() {
  $("finals").textContent = "";
  $("partial").textContent = "";
  page.finals = [];
  page.latencies_ms = [];
  page.messages = [];
  segmentText = [];
  sentLog = [];
  sentSamples = 0;
}

// `open(onBlock, onEnd)` returns a source; the stream opens once the source is ready.
async function stream(open, label) {
  clearTranscript();
  gotReady = false;
  setState("connecting", `opening ${label}`);
  try {
    source = await open(sendBlock, () => endInput());
  } catch (e) {
    setState("error", `${label} unavailable: ${e.message}`, true);
    return;
  }
  setState("connecting", "connecting");
  ws = new WebSocket(wsUrl());
  ws.binaryType = "arraybuffer";
  ws.onmessage = onMessage;
  ws.onclose = onClose;
  ws.onopen = () => {
    const config = {
      type: "config",
      sample_rate: source.sampleRate,
      encoding: "pcm_f32le",
      interim_results: true,
      context_right: Number($("mode").value),
    };
    if (!$("language-box").hidden) config.language = $("language").value;
    ws.send(JSON.stringify(config));
  };
}

async function playFile(blob, label) {
  const decoded = await window.audioSources.decodeAudio(await blob.arrayBuffer());
  return stream((onBlock, onEnd) => window.audioSources.playAtRealTime(decoded, onBlock, onEnd), label);
}

async function trySample() {
  const sample = page.samples[nextSample++ % page.samples.length];
  $("reference").textContent = `sample ${sample.audio_filepath}, reference: "${sample.text}"`;
  try {
    const blob = await (await fetch(`/samples/${sample.audio_filepath}`)).blob();
    await playFile(blob, "sample");
  } catch (e) {
    setState("error", `sample unavailable: ${e.message}`, true);
  }
}

async function pickFile() {
  const file = $("file").files[0];
  if (!file) return;
  $("reference").textContent = `file ${file.name}`;
  try {
    await playFile(file, "file");
  } catch (e) {
    setState("error", `cannot decode ${file.name}: ${e.message}`, true);
  }
  $("file").value = ""; // picking the same file again streams it again
}

async function stop() {
  setState("finishing", "finishing");
  if (source) await source.finish();
  endInput(); // the last final arrives, then done
}

$("start").onclick = () => {
  $("reference").textContent = "";
  stream((onBlock) => window.audioSources.openMicrophone(onBlock), "microphone");
};
$("sample").onclick = trySample;
$("file").onchange = pickFile;
$("stop").onclick = stop;
setState("idle");
loadInfo();
loadSamples();
setTimeout(pollSlots, SLOT_POLL_MS);

// The microphone page: capture -> AudioWorklet -> int16 frames over the WebSocket -> text.
// The AudioContext asks for 16 kHz so the browser downsamples; the server resamples whatever
// rate it is told, so a browser that refuses 16 kHz still works at its native rate.
"use strict";

const $ = (id) => document.getElementById(id);
const query = new URLSearchParams(location.search);
const token = query.get("token"); // browsers cannot set WebSocket headers: the token rides in the URL

// For tests and curious users: everything the page received.
const page = (window.nemoServe = { state: "idle", messages: [], finals: [] });

let ws = null;
let audio = null; // { ctx, source, node, stream }
let gotReady = false;
// The current segment's text as a list of code points: a partial of a long segment carries it
// from `text_offset` (code points) on; what came before stays (docs/protocol.md).
let segmentText = [];

function setState(state, text, isError = false) {
  page.state = state;
  document.body.dataset.state = state;
  $("status").textContent = text || state;
  $("status").className = isError ? "error" : "";
  $("start").disabled = !["idle", "done", "error"].includes(state);
  $("stop").disabled = state !== "streaming";
}

async function loadInfo() {
  try {
    const r = await fetch("/readyz");
    const info = await r.json();
    $("info").textContent =
      `${info.model} - chunk ${info.chunk_ms} ms - ${info.free_slots}/${info.total_slots} slots free` +
      (info.draining ? " - draining" : "");
    if (info.languages) {
      const sel = $("language");
      sel.innerHTML = info.languages.map((l) => `<option>${l}</option>`).join("");
      $("language-box").hidden = false;
    }
    return info;
  } catch (e) {
    $("info").textContent = "server unreachable";
    return null;
  }
}

function wsUrl() {
  const u = new URL("/ws", location.href);
  u.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  if (token) u.searchParams.set("token", token);
  return u.toString();
}

async function openAudio() {
  const stream = await navigator.mediaDevices.getUserMedia({
    // ASR wants the raw signal: no echo cancellation, noise suppression or gain riding.
    audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false },
  });
  let ctx = new AudioContext({ sampleRate: 16000 });
  let source;
  try {
    source = ctx.createMediaStreamSource(stream);
  } catch (e) {
    // Some browsers cannot connect a microphone to a context at another rate.
    await ctx.close();
    ctx = new AudioContext();
    source = ctx.createMediaStreamSource(stream);
  }
  await ctx.audioWorklet.addModule("/static/capture-worklet.js");
  const node = new AudioWorkletNode(ctx, "capture-processor");
  // A node must reach the destination to be pulled by the render thread; a zero gain keeps it silent.
  const mute = ctx.createGain();
  mute.gain.value = 0;
  node.connect(mute).connect(ctx.destination);
  await ctx.resume();
  return { ctx, source, node, stream };
}

function toInt16(samples) {
  const out = new Int16Array(samples.length);
  for (let i = 0; i < samples.length; i++) {
    const s = Math.max(-1, Math.min(1, samples[i]));
    out[i] = s < 0 ? s * 0x8000 : s * 0x7fff;
  }
  return out.buffer;
}

function send(samples) {
  if (ws && ws.readyState === WebSocket.OPEN && samples.length) ws.send(toInt16(samples));
}

function onMessage(event) {
  const msg = JSON.parse(event.data);
  page.messages.push(msg);
  if (msg.type === "ready") {
    gotReady = true;
    setState("streaming", `streaming (chunk ${msg.chunk_ms} ms)`);
  } else if (msg.type === "partial") {
    segmentText = segmentText.slice(0, msg.text_offset || 0).concat(Array.from(msg.text));
    $("partial").textContent = segmentText.join("");
  } else if (msg.type === "final") {
    segmentText = [];
    $("partial").textContent = "";
    if (msg.text) {
      page.finals.push(msg.text);
      const p = document.createElement("p");
      const t = document.createElement("span");
      t.className = "t";
      t.textContent = `${msg.start_time.toFixed(1)} s`;
      p.append(t, document.createTextNode(msg.text));
      $("finals").append(p);
    }
  } else if (msg.type === "error") {
    setState("error", `error: ${msg.reason}`, true);
  } else if (msg.type === "done") {
    setState("done", `done (${msg.audio_processed.toFixed(1)} s of audio)`);
  }
}

async function onClose(event) {
  stopAudio();
  if (page.state === "error" || page.state === "done") return;
  if (!gotReady) {
    // Refused at the handshake (HTTP 503/401): the browser hides the reason, /readyz tells it.
    const info = await loadInfo();
    let why = `connection refused (code ${event.code})`;
    if (info && info.draining) why = "server is shutting down";
    else if (info && info.free_slots === 0) why = "server busy: no free slot, try again later";
    else if (info && info.auth && !token) why = "this server needs ?token=... in the page URL";
    setState("error", why, true);
  } else {
    setState("error", `connection closed (code ${event.code}${event.reason ? ": " + event.reason : ""})`, true);
  }
}

async function start() {
  setState("connecting", "opening microphone");
  $("finals").textContent = "";
  $("partial").textContent = "";
  page.finals = [];
  gotReady = false;
  segmentText = [];
  try {
    audio = await openAudio();
  } catch (e) {
    setState("error", `microphone unavailable: ${e.message}`, true);
    return;
  }
  setState("connecting", "connecting");
  ws = new WebSocket(wsUrl());
  ws.binaryType = "arraybuffer";
  ws.onmessage = onMessage;
  ws.onclose = onClose;
  ws.onopen = () => {
    const config = { type: "config", sample_rate: audio.ctx.sampleRate, encoding: "pcm_s16le", interim_results: true };
    if (!$("language-box").hidden) config.language = $("language").value;
    ws.send(JSON.stringify(config));
    audio.node.port.onmessage = (e) => (e.data instanceof Float32Array ? send(e.data) : null);
    audio.source.connect(audio.node);
  };
}

function stopAudio() {
  if (!audio) return;
  audio.source.disconnect();
  audio.stream.getTracks().forEach((t) => t.stop());
  audio.ctx.close();
  audio = null;
}

async function stop() {
  setState("finishing", "finishing");
  if (audio) {
    // Send what the worklet still holds, then end input; the final arrives, then done.
    const a = audio;
    const flushed = new Promise((resolve) => {
      a.node.port.onmessage = (e) => {
        if (e.data instanceof Float32Array) send(e.data);
        else if (e.data && e.data.flushed) resolve(e.data.flushed);
      };
    });
    a.node.port.postMessage("flush");
    const timeout = new Promise((resolve) => setTimeout(() => resolve(new Float32Array(0)), 500));
    send(await Promise.race([flushed, timeout]));
    stopAudio();
  }
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "end" }));
}

$("start").onclick = start;
$("stop").onclick = stop;
setState("idle");
loadInfo();

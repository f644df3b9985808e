// Where the page's audio comes from: the microphone, or decoded samples played at real-time pace.
// Both hand float32 blocks of about 100 ms to `onBlock` and report their rate; app.js sends them.
"use strict";

const BLOCK_S = 0.1; // one WebSocket frame per 100 ms, as a microphone would send

// The microphone through an AudioWorklet. The context asks for 16 kHz so the browser downsamples;
// the server resamples whatever rate it is told, so a browser that refuses 16 kHz still works.
async function openMicrophone(onBlock) {
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
  return {
    sampleRate: ctx.sampleRate,
    start() {
      node.port.onmessage = (e) => (e.data instanceof Float32Array ? onBlock(e.data) : null);
      source.connect(node);
    },
    // Hand over what the worklet still holds, then release the device.
    async finish() {
      const flushed = new Promise((resolve) => {
        node.port.onmessage = (e) => {
          if (e.data instanceof Float32Array) onBlock(e.data);
          else if (e.data && e.data.flushed) resolve(e.data.flushed);
        };
      });
      node.port.postMessage("flush");
      const timeout = new Promise((resolve) => setTimeout(() => resolve(new Float32Array(0)), 500));
      onBlock(await Promise.race([flushed, timeout]));
      this.close();
    },
    close() {
      source.disconnect();
      stream.getTracks().forEach((t) => t.stop());
      ctx.close();
    },
  };
}

// Any file the browser can decode, mixed to mono at 16 kHz. An OfflineAudioContext decodes
// without an output device (and without a user gesture); a 16 kHz file comes out sample-exact.
async function decodeAudio(arrayBuffer) {
  const ctx = new OfflineAudioContext(1, 1, 16000);
  const buffer = await ctx.decodeAudioData(arrayBuffer);
  const mono = new Float32Array(buffer.length);
  for (let c = 0; c < buffer.numberOfChannels; c++) {
    const channel = buffer.getChannelData(c);
    for (let i = 0; i < mono.length; i++) mono[i] += channel[i] / buffer.numberOfChannels;
  }
  return { samples: mono, sampleRate: buffer.sampleRate };
}

// Decoded samples played as a live source: block i goes out at start + i x 100 ms. Timers are
// scheduled against the start time, not chained, so a late timer does not push the rest later.
function playAtRealTime({ samples, sampleRate }, onBlock, onEnd) {
  const blockLen = Math.round(sampleRate * BLOCK_S);
  let timer = null;
  let next = 0;
  let t0 = 0;
  const tick = () => {
    const due = Math.floor((performance.now() - t0) / (BLOCK_S * 1000)) + 1;
    while (next < samples.length && next < due * blockLen) {
      onBlock(samples.subarray(next, next + blockLen));
      next += blockLen;
    }
    if (next >= samples.length) {
      timer = null;
      onEnd();
      return;
    }
    timer = setTimeout(tick, t0 + (next / blockLen) * BLOCK_S * 1000 - performance.now());
  };
  return {
    sampleRate,
    start() {
      t0 = performance.now();
      tick();
    },
    async finish() {
      this.close();
    },
    close() {
      if (timer !== null) clearTimeout(timer);
      timer = null;
    },
  };
}

window.audioSources = { openMicrophone, decodeAudio, playAtRealTime };

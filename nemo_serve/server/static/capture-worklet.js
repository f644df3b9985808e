// Audio thread: collect the microphone's 128-sample render quanta into ~100 ms blocks and hand
// them to the page, which sends them. Posting every quantum (2.7-8 ms) would mean hundreds of
// tiny WebSocket frames a second.
class CaptureProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.block = new Float32Array(Math.round(sampleRate / 10));
    this.used = 0;
    this.port.onmessage = (e) => {
      if (e.data === "flush") {
        this.port.postMessage({ flushed: this.block.slice(0, this.used) });
        this.used = 0;
      }
    };
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (!channel) return true;
    let i = 0;
    while (i < channel.length) {
      const n = Math.min(channel.length - i, this.block.length - this.used);
      this.block.set(channel.subarray(i, i + n), this.used);
      this.used += n;
      i += n;
      if (this.used === this.block.length) {
        this.port.postMessage(this.block.slice());
        this.used = 0;
      }
    }
    return true;
  }
}

registerProcessor("capture-processor", CaptureProcessor);

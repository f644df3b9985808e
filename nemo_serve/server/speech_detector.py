"""Speech onset and end from a voice-activity detector: Silero VAD (the `silero-vad` package's
own ONNX model, run with onnxruntime and numpy).

Used by /v1/realtime for `input_audio_buffer.speech_started` / `.speech_stopped` with server
turn detection: voice agents interrupt their bot on speech_started, so it must follow the audio,
not the decoded text (the first token of a 1120 ms chunk comes 0.5-1 s after speech begins).
The detector only times those events; items still end where the endpointer ends them, so the
tokens stay /ws's.

Runs in the front end, per session, on the model-rate audio as it is appended: one 32 ms window
(512 samples at 16 kHz) costs about a tenth of a millisecond of CPU (benchmarks/vad_onset.py
measures it), small next to decoding the packet, so it stays on the event loop (rejected: a thread
hop per append, which costs as much as the window). Not torch: the front-end processes never
import it. The decision rule is silero's `VADIterator` (start at `threshold`, end after
`min_silence_s` below `threshold - 0.15`), rewritten over numpy. Rejected: webrtcvad (an energy
and GMM detector from 2017, fooled by noise, and its package has no wheels for new Pythons).
"""

from __future__ import annotations

import importlib.util
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

WINDOW = {16000: 512, 8000: 256}  # samples per call, the only sizes the model takes
CONTEXT = {16000: 64, 8000: 32}  # samples of the previous window the model sees again
HYSTERESIS = 0.15  # silero's: speech ends below threshold - 0.15

_session = None
_session_lock = threading.Lock()


def _model():
    """One onnxruntime session per process (its run() is thread-safe), loaded on first use."""
    global _session
    with _session_lock:
        if _session is None:
            import onnxruntime

            path = model_path()
            opts = onnxruntime.SessionOptions()
            opts.inter_op_num_threads = opts.intra_op_num_threads = 1  # per-window calls: threads only cost
            _session = onnxruntime.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
        return _session


def model_path() -> Path:
    """silero-vad's ONNX file, found without importing the package: its `__init__` imports
    torch, seconds on the front end's event loop (every handshake on it waits) and a few hundred
    MB in a process that otherwise never loads it. (importlib.resources.files("silero_vad.data")
    imports it.)"""
    spec = importlib.util.find_spec("silero_vad")  # a top-level package: located, not run
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("silero_vad")
    path = Path(spec.submodule_search_locations[0]) / "data" / "silero_vad.onnx"
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


def available(sample_rate: int) -> bool:
    """The detector can run at this rate, and silero-vad and onnxruntime are installed."""
    if sample_rate not in WINDOW:
        return False
    try:
        _model()
    except (ImportError, ModuleNotFoundError, FileNotFoundError, OSError):
        return False
    return True


@dataclass
class SpeechEvent:
    kind: str  # "started" or "stopped"
    sample: int  # position in the detector's audio (model-rate samples from the session's start)


class SpeechDetector:
    """One session's detector: audio in (any sizes), onsets and ends out. Not thread-safe."""

    def __init__(self, sample_rate: int, threshold: float = 0.5, min_silence_s: float = 0.5) -> None:
        self.rate = sample_rate
        self.window = WINDOW[sample_rate]
        self.threshold = threshold
        self.min_silence_samples = int(min_silence_s * sample_rate)
        self.session = _model()
        self._sr = np.array(sample_rate, dtype=np.int64)
        self._state = np.zeros((2, 1, 128), dtype=np.float32)
        self._context = np.zeros((1, CONTEXT[sample_rate]), dtype=np.float32)
        self._pending = np.zeros(0, dtype=np.float32)
        self.num_samples = 0  # samples run through the model
        self.speaking = False
        self._silent_since: int | None = None  # where the current dip below the end level began

    def push(self, samples: np.ndarray) -> list[SpeechEvent]:
        events: list[SpeechEvent] = []
        audio = np.concatenate([self._pending, samples.astype(np.float32, copy=False)])
        n = len(audio) // self.window * self.window
        for start in range(0, n, self.window):
            event = self._window(audio[start : start + self.window])
            if event is not None:
                events.append(event)
        self._pending = audio[n:]
        return events

    def flush(self) -> list[SpeechEvent]:
        """The audio ended (or was committed): speech still on ends where the audio does."""
        if not self.speaking:
            return []
        self.speaking, self._silent_since = False, None
        return [SpeechEvent("stopped", self.num_samples + len(self._pending))]

    def _window(self, x: np.ndarray) -> SpeechEvent | None:
        inp = np.concatenate([self._context, x[None, :]], axis=1)
        prob, self._state = self.session.run(None, {"input": inp, "state": self._state, "sr": self._sr})
        self._context = inp[:, -self._context.shape[1] :]
        start = self.num_samples
        self.num_samples += self.window
        p = float(prob.reshape(-1)[0])
        if p >= self.threshold:
            self._silent_since = None
            if not self.speaking:
                self.speaking = True
                return SpeechEvent("started", start)
            return None
        if self.speaking and p < self.threshold - HYSTERESIS:
            if self._silent_since is None:
                self._silent_since = start
            if self.num_samples - self._silent_since >= self.min_silence_samples:
                end, self.speaking, self._silent_since = self._silent_since, False, None
                return SpeechEvent("stopped", end)
        return None

"""/v1/realtime tests' audio and references: the bundled utterance as PCM16 at a rate, base64,
and /ws's finals for the same samples (test_realtime.py, test_picows_listener.py, test_words.py)."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np

import nemo_serve

from .helpers_server import finals_tokens_and_text, pcm16_file, ws_pcm16_finals


TRANSCRIPTION = "conversation.item.input_audio_transcription"


def pcm16(rate: int) -> np.ndarray:
    return pcm16_file(UTTERANCE, rate)


def b64(samples: np.ndarray) -> str:
    return base64.b64encode(samples.tobytes()).decode()


async def ws_reference(server, wire: np.ndarray, rate: int) -> tuple[list[int], str]:
    """/ws's tokens and text for the same PCM16 (packets of 100 ms, end)."""
    return finals_tokens_and_text(await ws_pcm16_finals(server, wire, rate))


def tokens_and_text(raw: list[dict]) -> tuple[list[int], str]:
    completed = [e for e in raw if e["type"] == f"{TRANSCRIPTION}.completed"]
    tokens = [t for e in completed for t in e["nemo_serve"]["token_ids"]]
    return tokens, " ".join(e["transcript"] for e in completed if e["transcript"])


UTTERANCE = Path(nemo_serve.__file__).parent / "assets" / "demo" / "utterances" / "000.wav"

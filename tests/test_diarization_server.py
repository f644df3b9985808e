"""Diarization through the real server (--diarizer builtin:tiny-sortformer) with the websockets client.

A diarized /ws stream and a plain one on the same audio at once: identical tokens; the diarized
stream's tokens, words and finals carry speakers, each token's the most probable (of its first
max_speakers) in NeMo's own streaming loop at its time; the plain stream carries none. A bad
`diarization` option, and any on a server without a diarizer, is refused before audio.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import torch

from nemo_serve.builtin.sortformer import build_diarizer
from nemo_serve.diarization.load import DEFAULT_SETTING
from nemo_serve.diarization.reference import nemo_chunks, nemo_reference_preds, stream_features
from nemo_serve.diarization.settings import MODEL_CARD_SETTINGS, apply_settings
from tests import helpers
from tests.helpers_server import raw_session


def _frames(audio: np.ndarray) -> list:
    return [audio[i : i + 4000].astype("<f4").tobytes() for i in range(0, len(audio), 4000)]


def _oracle_speakers(audio: np.ndarray, times_s: list[float], max_speakers: int) -> list[int]:
    model = build_diarizer("tiny-sortformer")
    apply_settings(model, MODEL_CARD_SETTINGS[DEFAULT_SETTING])  # what the server's loader applies
    probs = nemo_reference_preds(model, nemo_chunks(model, stream_features(model, torch.from_numpy(audio)))).numpy()
    frame_s = 0.08
    return [int(np.argmax(probs[min(int(t / frame_s + 1e-6), len(probs) - 1), :max_speakers])) for t in times_s]


def test_ws_diarized_stream_beside_a_plain_one(shared_server, diarizing_server):
    """On the toy diarizer's server shared with test_diarization_protocols.py (helpers_server.py:
    --num-slots 4 --diarizer builtin:tiny-sortformer, as this test started its own, and a --grpc-port)."""
    audio = helpers.utterances(1, seed=7)[0]
    diarized = json.dumps({"type": "config", "diarization": {"max_speakers": 2}})
    end = json.dumps({"type": "end"})
    server = diarizing_server

    async def both():
        return await asyncio.gather(raw_session(server.ws_url, [diarized, *_frames(audio), end]),
                                    raw_session(server.ws_url, [*_frames(audio), end]),
                                    raw_session(server.ws_url, [json.dumps({"type": "config", "diarization": {"max_speakers": 5}})]),
                                    raw_session(server.ws_url, [diarized, end]))  # fmt: skip

    (with_speakers, code), (plain, plain_code), (bad, _), (no_audio, _) = asyncio.run(both())
    server.assert_no_leak()
    assert code == plain_code == 1000, (with_speakers[-3:], plain[-3:])
    finals = [m for m in with_speakers if m["type"] == "final"]
    plain_finals = [m for m in plain if m["type"] == "final"]
    assert [t for m in finals for t in m["token_ids"]] == [t for m in plain_finals for t in m["token_ids"]]
    assert any(m["token_ids"] for m in finals)
    times = [t for m in finals for t in m["timestamps"]]
    expected = _oracle_speakers(audio, times, 2)
    assert len(set(expected)) > 1, expected  # both speakers on tokens: a server that always says 0 must fail
    assert [s for m in finals for s in m["speakers"]] == expected
    for m in finals:
        assert len(m["speakers"]) == len(m["token_ids"])
        assert [w["speaker"] for w in m["words"]] == [m["speakers"][m["timestamps"].index(w["start"])] for w in m["words"]]
        if m["token_ids"]:
            assert m["speaker"] == max(set(m["speakers"]), key=lambda k: (m["speakers"].count(k), -k))
    assert all("speaker" not in m and "speakers" not in m for m in plain if m["type"] in ("partial", "final"))
    # docs/protocol.md: a final's speaker is null for a segment without tokens (here: no audio at all)
    empty = [m for m in no_audio if m["type"] == "final"]
    assert len(empty) == 1 and empty[0]["token_ids"] == [] and empty[0]["speakers"] == [], no_audio
    assert "speaker" in empty[0] and empty[0]["speaker"] is None, empty
    assert bad[-1]["type"] == "error" and "from 1 to 4" in bad[-1]["reason"], bad
    refused, _ = asyncio.run(raw_session(shared_server.ws_url, [diarized]))
    assert refused[-1]["type"] == "error" and "no diarizer loaded" in refused[-1]["reason"], refused

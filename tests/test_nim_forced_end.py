"""NIM's force_eou through the realtime session (server/realtime.py over the in-process engine
core, driven by hand): the engine decodes past the forced point, to the end of input, before the
front end hears of any result (the race a loaded machine showed: one item for the whole file).
The item still ends at the whole chunks before the forced append, with the tokens a client gets
from /ws's force_final once the model is there; the items joined are the unforced stream's."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest

from nemo_serve.server.realtime import RealtimeFormat

from . import helpers
from .helpers_server import TEST_MODEL
from .helpers_session import context as _ctx
from .helpers_session import until_slots_free as _until_free
from .test_forced_ends import _caught_up_reference, _run_to_done
from .test_realtime_items import _completed

RATE = 16000  # NIM's client sends the file's rate: no resampling
PACKET = 1600  # its 100 ms packets
FORCED_PACKET = 12  # force_eou on the 13th append (1.3 s)


@pytest.fixture(scope="module")
def tiny():
    return helpers.model(TEST_MODEL)


def _pcm16(audio: np.ndarray) -> np.ndarray:
    return np.clip(np.round(audio * 32768.0), -32768, 32767).astype("<i2")


def _append(pcm: np.ndarray, force_eou: bool) -> str:
    ev = {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm.tobytes()).decode()}
    if force_eou:
        ev["runtime_config"] = {"force_eou": "true"}  # as nvidia-riva-client sends it
    return json.dumps(ev)


def _nim_update() -> str:
    session = {"input_audio_format": "pcm16", "input_audio_params": {"sample_rate_hz": RATE, "num_channels": 1},
               "turn_detection": None}  # fmt: skip
    return json.dumps({"type": "transcription_session.update", "session": session})


def test_force_eou_ends_the_item_at_its_audio_when_the_engine_ran_past_it(tiny):
    pcm = _pcm16(np.concatenate(helpers.utterances(2, seed=3)))
    at = (FORCED_PACKET + 1) * PACKET
    reference = _caught_up_reference(tiny, pcm.astype(np.float32) / 32768.0, [at])
    assert len(reference) == 2 and reference[0][0] and reference[1][0], reference
    engine = helpers.new_engine(tiny, num_slots=2)  # not started: this test steps it

    async def run():
        wire = RealtimeFormat(_ctx(engine), "nim", {}, {})
        wire.on_text(_nim_update())
        for n, i in enumerate(range(0, len(pcm), PACKET)):
            wire.on_text(_append(pcm[i : i + PACKET], force_eou=n == FORCED_PACKET))
            wire.on_text(json.dumps({"type": "input_audio_buffer.commit"}))  # NIM's flush: ends nothing
        wire.on_text(json.dumps({"type": "input_audio_buffer.done"}))
        _run_to_done(engine)  # every chunk decoded before the event loop runs a single result
        events = await _completed(wire, 2)
        wire.session.close()
        await _until_free(engine)
        return events

    events = asyncio.run(run())
    assert [e["nemo_serve"]["token_ids"] for e in events] == [r[0] for r in reference]
    first_end = events[0]["nemo_serve"]["item_start"] + events[0]["nemo_serve"]["audio_processed"]
    assert first_end == pytest.approx(reference[0][1]) and reference[0][1] <= at / RATE
    assert events[-1]["is_last_result"] is True
    helpers.assert_engine_empty(engine)

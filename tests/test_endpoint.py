"""Endpoint rules, and that segments never change the tokens."""

import numpy as np
import pytest

from nemo_serve.engine.endpoint import EndpointConfig, EndpointDetector

from . import helpers


def test_rule2_needs_text_rule1_does_not():
    d = EndpointDetector(EndpointConfig(), frame_s=0.08)
    assert not d.is_endpoint(decoded_frames=15)  # 1.2 s of silence, no text: rule 2 does not apply
    assert d.is_endpoint(decoded_frames=30)  # 2.4 s: rule 1
    d.new_segment(30)
    d.on_tokens([31])
    assert not d.is_endpoint(decoded_frames=40)  # 0.64 s after the token
    assert d.is_endpoint(decoded_frames=32 + 15)  # 1.2 s after the token: rule 2


def test_rule3_caps_segment_length():
    d = EndpointDetector(EndpointConfig(), frame_s=0.08)
    for f in range(0, 250, 5):
        d.on_tokens([f])  # talking all the time
        assert not d.is_endpoint(f + 1)
    d.on_tokens([250])
    assert d.is_endpoint(251)  # 20.08 s


def test_disabled_never_fires():
    d = EndpointDetector(EndpointConfig.off(), frame_s=0.08)
    assert not d.is_endpoint(10_000)


def test_validation_rejects_nonsense():
    with pytest.raises(ValueError):
        EndpointConfig(rule1_min_trailing_silence_s=-1).validated()


def test_segments_concatenate_to_the_unsegmented_tokens():
    m = helpers.model(None, None)
    audios = helpers.utterances(3, seed=3)
    # Silence between speech so endpoints fire mid-stream.
    gap = np.zeros(int(1.5 * 16000), np.float32)
    long = [np.concatenate([a, gap, b, gap, c]) for a, b, c in zip(audios, audios[1:] + audios[:1], audios[2:] + audios[:2])]
    eager = EndpointConfig(rule1_min_trailing_silence_s=0.8, rule2_min_trailing_silence_s=0.4, rule3_min_utterance_length_s=2.0)
    on = helpers.drive(helpers.new_engine(m, 4, endpoint=eager), long, packet=[800, 3200, 160])
    off = helpers.drive(helpers.new_engine(m, 4), long, packet=[800, 3200, 160])
    for i in range(len(long)):
        finals = on.finals(i)
        assert len(finals) >= 2, "endpoints should have split the stream"
        assert [r.segment for r in finals] == list(range(len(finals)))
        assert [t for r in finals for t in r.token_ids] == off.tokens(i)
        assert on.tokens(i) == off.tokens(i)
        assert len(off.finals(i)) == 1

"""Endpoint rules, and that segments never change the tokens."""

import numpy as np
import pytest

from nemo_serve.engine.endpoint import EndpointConfig, EndpointDetector, frames_needed

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


def test_fires_at_is_the_first_frame_is_endpoint_fires_on_random_states():
    """`fires_at` (what collect compares per row, engine/collect.py) against the three rules
    evaluated frame by frame, on random thresholds (odd floats too), frame lengths and token
    histories: is_endpoint(d) fires exactly from fires_at on, for every state reached."""
    rng = np.random.default_rng(46)
    for _ in range(400):
        frame_s = float(rng.choice([0.04, 0.08, 0.01 * rng.integers(1, 15), rng.uniform(0.005, 0.2)]))
        config = EndpointConfig(
            rule1_min_trailing_silence_s=float(rng.choice([2.4, rng.uniform(0.01, 3.0)])),
            rule2_min_trailing_silence_s=float(rng.choice([1.2, rng.uniform(0.01, 2.0), 0.24])),
            rule3_min_utterance_length_s=float(rng.choice([20.0, rng.uniform(0.05, 4.0), 0.56])),
        )
        d = EndpointDetector(config, frame_s)
        decoded = int(rng.integers(0, 5))
        d.new_segment(decoded)
        for _ in range(int(rng.integers(1, 8))):
            decoded += int(rng.integers(0, 30))
            if rng.random() < 0.6:
                d.on_tokens(sorted(rng.integers(d.segment_start_frame, decoded + 1, size=int(rng.integers(1, 4))).tolist()))
            elif rng.random() < 0.3:
                d.new_segment(decoded)
            frames = range(d.segment_start_frame - 2, decoded + 400)
            assert [d.is_endpoint(f) is not None for f in frames] == [f >= d.fires_at for f in frames], (config, frame_s)
    off = EndpointDetector(EndpointConfig.off(), 0.08)
    off.on_tokens([3])
    assert off.fires_at > 10**15


def test_frames_needed_is_the_fewest_frames_passing_the_float_test():
    """The whole-frame form of is_endpoint's `x * frame_s >= min_s`, against a scan, on
    thresholds one ulp around a whole number of frames (where ceil(min_s / frame_s) is off by one
    either way)."""
    rng = np.random.default_rng(47)
    for _ in range(3000):
        frame_s = float(rng.uniform(0.005, 0.2))
        k = int(rng.integers(1, 400))
        # one ulp above, one below, or the product itself (where min_s / frame_s can round above k,
        # so ceil is one too many: the loop down; nextafter towards 0.0 was the one below again)
        min_s = float([np.nextafter(k * frame_s, np.inf), np.nextafter(k * frame_s, -np.inf), k * frame_s][int(rng.integers(0, 3))])
        scan = next(x for x in range(0, k + 3) if x * frame_s >= min_s)
        assert frames_needed(min_s, frame_s) == scan, (min_s, frame_s)


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

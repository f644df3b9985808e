"""The self-test's WER line: engine transcripts against the manifest's references, per set."""

import numpy as np

from nemo_serve.selftest import Outcome, Utterance, wer_line


def outcome(ref, hyp, group):
    o = Outcome(Utterance("x.wav", np.zeros(1, np.float32), None, ref, group), [], hyp)
    o.engine_text = hyp
    return o


def test_wer_line_counts_word_errors_overall_and_per_set():
    line = wer_line([
        outcome("turn on the light", "turn off the light", "a"),  # 1 substitution / 4
        outcome("set a timer", "set a timer", "a"),  # 0 / 3
        outcome("call mom", "", "b"),  # 2 deletions / 2
        outcome(None, "anything", "b"),  # no reference: not scored
    ])
    assert line == "WER against the references (3 utterances): all 33.3% (3/9), a 14.3% (1/7), b 100.0% (2/2)"


def test_no_references_no_line():
    assert wer_line([outcome(None, "hello", None)]) is None

"""step_bench measures several modes on one loaded model (`--context-right 3,13`): switching modes must give
the engine what loading at that mode gives it, or the second mode's numbers are of the wrong geometry."""

from __future__ import annotations

from benchmarks.step_bench import with_mode
from nemo_serve.model import DEMO_MODEL_PATH, load_model


def test_with_mode_matches_loading_at_that_mode():
    base = load_model(str(DEMO_MODEL_PATH), context_right=3)
    switched = with_mode(base, 13)
    loaded = load_model(str(DEMO_MODEL_PATH), context_right=13)
    assert switched.geometry == loaded.geometry
    assert switched.geometries == loaded.geometries == {13: loaded.geometry}
    assert switched.geometry != base.geometry  # 1120 ms chunks, not 320
    assert list(switched.nemo.encoder.att_context_size) == [56, 13]

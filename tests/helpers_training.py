"""Shared by the training tests: the skip mark for the speech synthesizers the corpus needs."""

from __future__ import annotations

import shutil

import pytest

needs_synthesizers = pytest.mark.skipif(
    any(shutil.which(tool) is None for tool in ("espeak-ng", "flite", "text2wave")),
    reason="espeak-ng, flite and festival (text2wave) are needed to synthesize the corpus",
)

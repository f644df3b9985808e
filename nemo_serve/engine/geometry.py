"""What the front ends need to know about the served model, without torch or NeMo.

The front-end processes import only this (and results.py) from the engine, so each starts in
about a second and holds no model: chunk geometry, vocabulary, languages and the readiness rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class UnsupportedModeError(ValueError):
    """--context-right names a mode the model was not trained for."""


def parse_modes(value) -> list[int] | str | None:
    """--context-right as given: None (the model's first mode), an int, "all", or a list such as "0,3,13"
    (the first is the default for streams that do not choose)."""
    if value is None:
        return None
    text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value).strip().lower()
    if text == "all":
        return "all"
    try:
        modes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UnsupportedModeError(f"--context-right {value!r}: give an integer, a list such as 0,3,13, or all") from None
    if not modes or len(set(modes)) != len(modes) or min(modes) < 0:
        raise UnsupportedModeError(f"--context-right {value!r}: give distinct non-negative integers, or all")
    return modes


def served_geometry(geometries: dict, default, context_right: int | None):
    """The geometry of a served mode (None: the default `default`); UnsupportedModeError, a
    ValueError, lists the served modes otherwise. Used by the engine's model and the front ends."""
    if context_right is None:
        return default
    g = geometries.get(context_right)
    if g is None:
        valid = ", ".join(str(r) for r in geometries)
        raise UnsupportedModeError(f"context_right {context_right} is not served here; valid values: {valid}")
    return g


@dataclass(frozen=True)
class ChunkGeometry:
    """Chunk sizes in feature frames for one att_context mode, as NeMo's `setup_streaming_params` sets them.

    First chunk: `first_frames` new frames, no pre-encode cache, drop 0.
    Later chunks: `pre_cache_frames` history + `chunk_frames` new frames, drop `drop_frames`.
    """

    context_left: int
    context_right: int
    first_frames: int  # 1 + 8R
    chunk_frames: int  # 8(R+1)
    pre_cache_frames: int  # 9
    drop_frames: int  # 2
    min_first_frames: int  # shortest first chunk NeMo's loop encodes (sampling_frames[0])
    min_later_frames: int  # shortest later chunk NeMo's loop encodes (sampling_frames[1])
    hop_samples: int  # 160
    sample_rate: int  # 16000
    subsampling: int  # 8

    @property
    def chunk_ms(self) -> float:
        return 1000.0 * self.chunk_frames * self.hop_samples / self.sample_rate

    @property
    def encoder_frames(self) -> int:
        """Encoder frames a full chunk adds (NeMo's valid_out_len: R + 1)."""
        return self.chunk_frames // self.subsampling

    @property
    def encoder_frame_s(self) -> float:
        return self.subsampling * self.hop_samples / self.sample_rate


def frames_available(num_samples, finished, hop: int, margin: int):
    """Feature frames whose every input sample has arrived, for one stream or arrays of them:
    (n - margin) // hop + 1 while input continues; once it ended, all of NeMo's floor(n / hop) + 1
    frames (the last one masked)."""
    n = np.asarray(num_samples)
    streaming = np.where(n >= margin, (n - margin) // hop + 1, 0)
    ended = np.where(n > 0, n // hop + 1, 0)
    return np.where(finished, ended, streaming)


def language_index(prompt_dictionary: dict[str, int] | None, default_language: str | None, language: str | None) -> int:
    """Prompt index for `language` (None -> default); raises ValueError with the valid codes."""
    if prompt_dictionary is None:
        if language not in (None, ""):
            raise ValueError("this model has no language prompts; omit 'language'")
        return 0
    code = language or default_language
    if code not in prompt_dictionary:
        codes = ", ".join(sorted(prompt_dictionary))
        raise ValueError(f"unknown language {code!r}; valid: {codes}")
    return int(prompt_dictionary[code])


@dataclass(frozen=True)
class ModelInfo:
    """The served model as the network side sees it (`ServerContext.model`), in every mode."""

    name: str
    geometry: ChunkGeometry
    vocabulary: list[str]
    is_bpe: bool
    prompt_dictionary: dict[str, int] | None
    default_language: str | None
    feature_margin: int  # samples a feature frame reads past its hop (readiness rule)
    summary: str  # the start-up line
    geometries: dict[int, ChunkGeometry] | None = None  # every served mode by right context; the first is the default
    num_speakers: int | None = None  # the diarizer's speakers (--diarizer); None: none loaded

    @property
    def modes(self) -> tuple[int, ...]:
        return tuple(self.geometries) if self.geometries else (self.geometry.context_right,)

    def geometry_for(self, context_right: int | None) -> ChunkGeometry:
        """A served mode's geometry (None: the default); ValueError lists the served modes."""
        geometries = self.geometries or {self.geometry.context_right: self.geometry}
        return served_geometry(geometries, self.geometry, context_right)

    def language_index(self, language: str | None) -> int:
        return language_index(self.prompt_dictionary, self.default_language, language)

    def whole_chunks_s(self, context_right: int | None, num_samples: int) -> float:
        """Audio the engine steps of a stream's first `num_samples` model-rate samples while its
        input stays open: every whole chunk whose feature windows have arrived (the readiness
        rule, frames_available), in seconds as results report `audio_processed_s`; 0.0 before the
        first chunk. Where a commit on a continuing stream falls (NIM's commits, server/realtime.py),
        so the server never redoes the chunk arithmetic."""
        g = self.geometry_for(context_right)
        frames = whole_chunk_frames(g, num_samples, self.feature_margin)
        return round(frames * g.hop_samples / g.sample_rate, 3)


def whole_chunk_frames(g: ChunkGeometry, num_samples: int, margin: int) -> int:
    """Feature frames of every whole chunk whose feature windows the first `num_samples` samples
    hold while input stays open (the readiness rule, frames_available); 0 before the first chunk.
    Where a positional forced final ends its segment (Engine.force_final's `at_sample`)."""
    frames = int(frames_available(num_samples, False, g.hop_samples, margin))
    if frames < g.first_frames:
        return 0
    return g.first_frames + (frames - g.first_frames) // g.chunk_frames * g.chunk_frames

"""An uploaded audio file -> float32 mono samples at the model's rate (POST /v1/audio/transcriptions).

libsndfile (the soundfile package) reads the container: WAV (PCM 8/16/24/32-bit, float, A-law,
mu-law), FLAC, OGG Vorbis and Opus, MP3, AIFF, CAF and its other formats, at any rate. Channels
are averaged. The rate is changed with soxr's streaming resampler at the quality /ws uses, whose
output equals its one-shot output (audio.py), so a file and the same samples streamed to /ws give
the model the same input.

A compressed file is a decompression bomb in waiting: 240 kB of FLAC holds 10 minutes of 8-channel
48 kHz silence, 0.9 GB as float32. So the header's rate, channels and length are checked against
the limits before any decoding, and the audio is decoded in blocks of at most BLOCK_BYTES, each
downmixed and resampled before the next is read: peak memory is the mono output at the model's
rate (4 bytes x model rate x --max-stream-s at most: 230 MB for an hour at 16 kHz) plus about
16 MiB for the block in flight, whatever the channels and rate. A header that does not know its
length (a FLAC written to a pipe says 0 samples) is decoded up to the limit and stopped there.
The caller runs this off the event loop (it takes seconds for an hour of audio).
"""

from __future__ import annotations

import io
import math

import numpy as np
import soundfile
import soxr

# What /v1/audio/transcriptions names in its 400 when libsndfile cannot open the bytes.
READABLE = "WAV, FLAC, OGG (Vorbis, Opus), MP3, AIFF, CAF"
MAX_CHANNELS = 8  # 7.1; more is a multitrack recording, not speech to transcribe
MIN_RATE, MAX_RATE = 1000, 192_000  # Hz; what a recorder writes, not what a forged header says
# Input samples (frames x channels) per second of the duration limit: an hour of 48 kHz stereo
# at the default. Bounds the decoding work before it starts (10 min of 8 x 48 kHz is 230 M).
MAX_INPUT_SAMPLES_PER_LIMIT_S = 96_000
BLOCK_BYTES = 4 << 20  # one decoded block, all channels, float32
UNKNOWN_FRAMES = 1 << 62  # libsndfile says SF_COUNT_MAX when the header does not know


class FileAudioError(ValueError):
    """The file cannot be used; the message says why, for the client."""


class FileTooLong(FileAudioError):
    """Longer than the server's limit on one stream's audio."""


def decode_file(data: bytes, model_rate: int, max_seconds: float) -> tuple[np.ndarray, float]:
    """(samples at `model_rate`, the file's duration in s). Checks the header against the limits
    before decoding, so an over-long or over-wide file costs no decoding."""
    if not data:
        raise FileAudioError("the file is empty (0 bytes)")
    try:
        f = soundfile.SoundFile(io.BytesIO(data))
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        raise FileAudioError(f"cannot decode the file as audio ({_why(e)}); readable formats: {READABLE}") from None
    with f:
        max_frames = _check_header(f.samplerate, f.channels, f.frames, max_seconds)
        try:
            samples, num_frames = _decode_blocks(f, model_rate, max_frames, max_seconds)
        except (soundfile.LibsndfileError, RuntimeError) as e:
            raise FileAudioError(f"the audio data is corrupt or cut short ({_why(e)})") from None
    if not num_frames:
        raise FileAudioError("the file holds no audio samples")
    return samples, num_frames / f.samplerate


def _check_header(rate: int, channels: int, frames: int, max_seconds: float) -> int:
    """The most frames the file may hold; FileAudioError/FileTooLong when its header is beyond
    the limits."""
    if not MIN_RATE <= rate <= MAX_RATE:
        raise FileAudioError(f"the file's sample rate is {rate} Hz; this server takes {MIN_RATE} to {MAX_RATE} Hz")
    if not 1 <= channels <= MAX_CHANNELS:
        raise FileAudioError(f"the file has {channels} channels; this server takes 1 to {MAX_CHANNELS}")
    max_frames = min(int(max_seconds * rate), int(max_seconds * MAX_INPUT_SAMPLES_PER_LIMIT_S) // channels)
    if frames < UNKNOWN_FRAMES and frames > max_frames:
        raise FileTooLong(_too_long(frames / rate, rate, channels, max_seconds))
    return max_frames


def _too_long(duration_s: float, rate: int, channels: int, max_seconds: float) -> str:
    if duration_s > max_seconds:
        return f"audio is {duration_s:.1f} s long; this server takes at most {max_seconds:g} s (--max-stream-s)"
    limit_s = max_seconds * MAX_INPUT_SAMPLES_PER_LIMIT_S / (channels * rate)
    return (f"audio is {duration_s:.1f} s of {channels} channels at {rate} Hz; this server decodes at most "
            f"{limit_s:.1f} s of that ({MAX_INPUT_SAMPLES_PER_LIMIT_S * max_seconds:,.0f} samples over all channels)")  # fmt: skip


def _decode_blocks(f: soundfile.SoundFile, model_rate: int, max_frames: int, max_seconds: float) -> tuple[np.ndarray, int]:
    """Read, downmix and resample block by block into one preallocated output; stop (FileTooLong)
    one frame past `max_frames`, whatever the header said."""
    rate, channels = f.samplerate, f.channels
    block = np.empty((max(1024, BLOCK_BYTES // (4 * channels)), channels), dtype=np.float32)
    resampler = soxr.ResampleStream(rate, model_rate, 1, dtype="float32", quality="HQ") if rate != model_rate else None
    expected = f.frames if f.frames < UNKNOWN_FRAMES else max_frames
    # np.empty of the bound: pages never written are never resident (a lying header costs nothing)
    out = np.empty(math.ceil(min(expected, max_frames) * model_rate / rate) + 64, dtype=np.float32)
    num_out = num_frames = 0
    while True:
        read, last = _read_block(f, block, known_length=f.frames < UNKNOWN_FRAMES)
        num_frames += len(read)
        if num_frames > max_frames:  # only when the header did not say (libsndfile stops at what it says)
            raise FileTooLong(f"audio goes on past {max_frames / rate:.1f} s, the most this server decodes of "
                              f"{channels} channel(s) at {rate} Hz (--max-stream-s); its header does not say how long it is")  # fmt: skip
        mono = read[:, 0] if channels == 1 else read.mean(axis=1, dtype=np.float32)
        if not np.isfinite(mono).all():
            raise FileAudioError("audio contains NaN or Inf samples")
        if resampler is not None:
            mono = resampler.resample_chunk(mono, last=last)
        if num_out + len(mono) > len(out):  # the header said fewer frames than there are
            out = np.resize(out, max(num_out + len(mono), 2 * len(out)))
        out[num_out : num_out + len(mono)] = mono
        num_out += len(mono)
        if last:
            return out[:num_out], num_frames


def _read_block(f: soundfile.SoundFile, block: np.ndarray, known_length: bool) -> tuple[np.ndarray, bool]:
    """(the next frames, in a view of `block`: no allocation per block; whether they are the
    last). At the end of a file
    that does not know its length, soundfile's seek after the last short read fails and it
    raises, without saying how many frames it read: those are told by a NaN fill that the
    decoder never writes (a NaN it did write is refused anyway). Rejected: soundfile's private
    `_snd.sf_readf_float`, which returns the count but would tie us to soundfile's internals."""
    if not known_length:
        block.fill(np.nan)
    try:
        read = f.read(out=block)
    except soundfile.LibsndfileError:
        if known_length:
            raise
        written = ~np.isnan(block).all(axis=1)
        return block[: len(block) if written.all() else int(np.argmin(written))], True
    return read, len(read) < len(block)


def _why(e: Exception) -> str:
    """libsndfile's reason in a client's words: its own texts name C structs and pipes."""
    text = str(e).lower()
    for needle, said in _LIBSNDFILE_TEXTS:
        if needle in text:
            return said
    return "no known audio format starts like this"


_LIBSNDFILE_TEXTS = (
    ("format not recognised", "no known audio format starts like this"),
    ("possibly a pipe", "no known audio format starts like this"),
    ("sf_info struct incomplete", "its header is incomplete"),
    ("unsupported", "it uses an encoding this server cannot decode"),
    ("malformed", "its header is malformed"),
    ("end of file", "it ends before its header does"),
    ("unspecified internal error", "its data could not be decoded"),
)

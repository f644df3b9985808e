"""PCM16 audio that may begin with a WAV header: NIM's `input_audio_format: "none"`.

NVIDIA's realtime client, given a file, sends it as it lies on disk, header and all, in its
appends (riva.client.asr.AudioChunkFileIterator reads from byte 0), and says so with the input
format "none": the server reads the container. Decoding those 44 or more header bytes as samples
would put a loud click before the speech. So the first bytes are held until they show whether
the stream begins with `RIFF....WAVE`; if it does, everything up to the `data` chunk's payload
is dropped, after checking that the header describes what the session announced (PCM16, mono,
the session's rate); if not, they are PCM16 like the rest.
"""

from __future__ import annotations

import struct

import numpy as np

from .audio import AudioDecoder, AudioError

RIFF_HEAD_BYTES = 12  # "RIFF", size, "WAVE"
MAX_HEADER_BYTES = 64 * 1024  # a header with this much metadata before `data` is refused


class WavStreamDecoder(AudioDecoder):
    def __init__(self, input_rate: int, model_rate: int) -> None:
        super().__init__("pcm_s16le", input_rate, model_rate)
        self._head = b""  # bytes held until the header question is settled
        self._pos = RIFF_HEAD_BYTES  # the next RIFF chunk to read in _head
        self._settled = False

    def decode(self, data: bytes) -> np.ndarray:
        if self._settled:
            return super().decode(data)
        self._head += data
        payload = self._payload()
        if payload is None:
            return np.zeros(0, dtype=np.float32)  # need more bytes to tell
        self._settled, self._head = True, b""
        if len(payload) % 2:  # appends are whole samples: an odd payload means an odd-sized header
            raise AudioError("WAV data chunk does not start on a 16-bit sample boundary")
        return super().decode(payload)

    def _payload(self) -> bytes | None:
        """The samples after the header (all bytes if there is none), or None until decidable."""
        head = self._head
        if len(head) < RIFF_HEAD_BYTES:
            return None if b"RIFF".startswith(head[:4]) else head  # a prefix of "RIFF": wait for more
        if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            return head
        pos = self._pos  # resume after the chunks already read: re-reading them on every append
        # made a header of 8,000 empty chunks, 8 bytes an append, cost 44 s of the event loop
        while pos + 8 <= len(head):
            kind, size = head[pos : pos + 4], struct.unpack("<I", head[pos + 4 : pos + 8])[0]
            if kind == b"data":
                return head[pos + 8 :]
            if pos + 8 + size > len(head):
                break
            if kind == b"fmt ":
                self._check_format(head[pos + 8 : pos + 8 + size])
            pos += 8 + size + (size & 1)  # chunks are padded to even sizes
            self._pos = pos
        if len(head) > MAX_HEADER_BYTES:
            raise AudioError(f"WAV header longer than {MAX_HEADER_BYTES} bytes before its data chunk")
        return None

    def _check_format(self, fmt: bytes) -> None:
        if len(fmt) < 16:
            raise AudioError("WAV fmt chunk too short")
        tag, channels, rate, _, _, bits = struct.unpack("<HHIIHH", fmt[:16])
        if tag not in (1, 0xFFFE) or bits != 16 or channels != 1:
            raise AudioError(f"WAV audio must be 16-bit PCM mono (this one: format {tag}, {bits}-bit, {channels} channels)")
        if rate != self.input_rate:
            raise AudioError(f"WAV header says {rate} Hz but the session says {self.input_rate} Hz "
                             "(input_audio_params.sample_rate_hz)")  # fmt: skip

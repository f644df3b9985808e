"""The /ws end-to-end tests' client and checks: one streaming client at a chosen pace, the shape
every transcript must have, and NeMo's own loop on the same wire samples (used by
test_server_e2e.py, test_server_limits.py and the multi-process, multi-device, Ray, picows and
phrase-boost server tests)."""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np

from nemo_serve.client import StreamingClient, Transcript
from nemo_serve.oracle import oracle_transcribe

from .helpers_server import TOKEN, as_model_input


def oracle_tokens(model, wire: np.ndarray, rate: int) -> list[int]:
    return oracle_transcribe(model, as_model_input(wire, rate)).token_ids


async def stream(
    url: str,
    wire: np.ndarray,
    rate: int,
    encoding: str,
    *,
    packet: int = 1600,
    speed: float = 0.0,
    delay_s: float = 0.0,
    force_final_at: int | None = None,
    sent: list[tuple[float, int]] | None = None,
    until: asyncio.Event | None = None,
    **options,
) -> Transcript:
    """One client: config, packets of `packet` samples at `speed` x real time (0: no pacing), end.
    `sent`, if given, gets (monotonic time, samples sent so far) after each packet. `until`, if
    given, ends the input early once set (a stream that holds a server only as long as a test needs)."""
    await asyncio.sleep(delay_s)
    options.setdefault("token", TOKEN)
    async with StreamingClient(url, sample_rate=rate, encoding=encoding, **options) as c:
        out = Transcript(ready=c.ready)

        async def send() -> None:
            t0 = time.monotonic()
            for i in range(0, len(wire), packet):
                if until is not None and until.is_set():
                    break
                if force_final_at is not None and i <= force_final_at < i + packet:
                    await c.force_final()
                await c.send_audio(wire[i : i + packet])
                if sent is not None:
                    sent.append((time.monotonic(), min(i + packet, len(wire))))
                if speed:
                    await asyncio.sleep(max(0.0, t0 + (i + packet) / rate / speed - time.monotonic()))
            await c.end()

        sender = asyncio.create_task(send())
        async for msg in c.messages():
            out.record(msg)
        # The server may end input itself (drain, duration cap) while we are still sending.
        await asyncio.gather(sender, return_exceptions=True)
        out.close_code = c.close_code
    return out


HOP_S, FRAME_S = 0.01, 0.08  # a feature frame (the preprocessor's stride), an encoder frame (8 of them)


def check_segment_times(finals: list[dict], duration_s: float | None) -> None:
    """protocol.md (`segment`, `start_time`): each segment starts where the one before it ended,
    at the end of the encoder frame the previous final's `audio_processed` falls in (that counts
    10 ms feature frames, `start_time` 80 ms encoder frames). So the first final starts at 0, each
    later one at the previous final's `audio_processed` rounded up to a whole encoder frame,
    each final's `audio_processed` is at or after its start, and none is past the audio (rounded
    up to a feature frame): the starts never go back. (A `force_final` before anything is decoded
    closes a segment of length 0, so two starts can be equal.)"""
    assert finals and finals[0]["start_time"] == 0.0, finals[:1]
    for prev, f in zip(finals, finals[1:]):
        frame_end = math.ceil(round(prev["audio_processed"] / FRAME_S, 6)) * FRAME_S  # 4.41 s -> 4.48 s
        assert abs(f["start_time"] - frame_end) <= 1e-3, (prev, f)
    for f in finals:  # `audio_processed` counts feature frames: the audio rounded up to a 10 ms hop
        assert f["start_time"] <= f["audio_processed"], f
        assert duration_s is None or f["audio_processed"] <= duration_s + HOP_S + 1e-3, (f, duration_s)


def check_well_formed(t: Transcript) -> None:
    assert t.error is None, t.error
    assert t.done is not None and t.close_code == 1000
    assert t.messages[-1]["type"] == "done"
    # protocol.md: segments number from 0 and go up after each final, an empty one too: no gaps
    # (this read "sorted and unique", which a stream that skipped a number passed)
    assert [f["segment"] for f in t.finals] == list(range(len(t.finals))), [f["segment"] for f in t.finals]
    check_segment_times(t.finals, None)  # each segment starts where the one before it ended
    for m in t.messages:
        if m["type"] in ("partial", "final"):
            assert len(m["tokens"]) == len(m["token_ids"]) == len(m["timestamps"])
            assert m["timestamps"] == sorted(m["timestamps"])
            assert all(ts >= m["start_time"] - 1e-6 for ts in m["timestamps"])
            assert m["audio_arrival_time"] <= m["sent_time"] + 1e-3
    processed = [m["audio_processed"] for m in t.messages if m["type"] in ("partial", "final")]
    assert processed == sorted(processed)

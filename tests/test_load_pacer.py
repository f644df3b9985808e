"""The picows client's pacer (benchmarks/load_pacer.py): packets in order at their due times, and a
stream held by the server's backpressure parked without its wait counted as the generator's lateness."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.load_level import StreamRecord  # noqa: E402
from benchmarks.load_pacer import EARLY_S, PacedStream, pacer  # noqa: E402

PACKETS = [(160, b"a"), (320, b"b"), (480, b"c")]  # 10 ms of 16 kHz audio each


def _stream(sent: list, writable: list[bool]) -> tuple[PacedStream, StreamRecord]:
    rec = StreamRecord(0, "item", 0.03)
    return PacedStream(PACKETS, rec, sent.append, lambda: writable[0], lambda: sent.append(b"end")), rec


def test_packets_leave_in_order_and_none_before_its_due_time():
    async def main():
        sent: list = []
        stream = PacedStream(PACKETS, StreamRecord(0, "item", 0.03), lambda p: sent.append((p, time.monotonic())),
                             lambda: True, lambda: sent.append((b"end", time.monotonic())))  # fmt: skip
        await asyncio.wait_for(pacer().send_all(stream), 2.0)
        assert [p for p, _ in sent] == [b"a", b"b", b"c", b"end"]
        for (end, _), (_, t) in zip(PACKETS, sent):  # a loaded machine may send late, never early
            assert t >= stream.t0 + end / 16000 - EARLY_S, (end, t - stream.t0)
        rec = stream.rec
        assert rec.send_ends == [160, 320, 480] and len(rec.send_lateness) == 3 and rec.end_sent is not None

    asyncio.run(main())


def test_a_stream_held_by_backpressure_is_parked_and_its_wait_is_not_lateness():
    async def main():
        sent: list = []
        writable = [False]
        stream, rec = _stream(sent, writable)
        task = asyncio.create_task(pacer().send_all(stream))
        await asyncio.sleep(0.2)  # the server reads nothing for 200 ms
        assert sent == [] and stream in pacer().parked
        writable[0] = True
        pacer().resume(stream)
        await asyncio.wait_for(task, 2.0)
        assert sent == [b"a", b"b", b"c", b"end"]
        assert max(rec.send_lateness) < 0.1, rec.send_lateness  # the 200 ms were the server's

    asyncio.run(main())


def test_a_failed_send_ends_its_stream_not_the_pacer():
    async def main():
        def broken(_payload):
            raise ConnectionError("closed")

        rec = StreamRecord(0, "item", 0.03)
        bad = PacedStream(PACKETS, rec, broken, lambda: True, lambda: None)
        sent: list = []
        good, _ = _stream(sent, [True])
        results = await asyncio.gather(pacer().send_all(bad), pacer().send_all(good), return_exceptions=True)
        assert isinstance(results[0], ConnectionError) and results[1] is None and sent[-1] == b"end"

    asyncio.run(main())

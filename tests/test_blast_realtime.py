"""benchmarks/blast.py's /v1/realtime mode at the OpenAI SDK's shape ("realtime24k": 20 ms appends of
base64 PCM16 at 24 kHz, session.update with transcription and turn_detection null, one commit) against
the real server: every append is taken (the item's tokens equal /ws's for the same 24 kHz samples,
as test_realtime.py's SDK test asks), and the lateness accounting is filled for every packet."""

from __future__ import annotations

import asyncio

import numpy as np

from benchmarks import blast
from benchmarks.load_items import LoadItem
from benchmarks.load_realtime import as_pcm16

from .helpers_realtime import pcm16, ws_reference
from .helpers_server import TOKEN
from .helpers_server import leak_checked_server  # noqa: F401 - this module's `server` fixture

NUM_PACKETS = 60  # 1.2 s of the utterance at real-time pace


def test_blast_realtime24k_appends_are_taken_and_each_packet_timed(server):
    audio = pcm16(16000)[: NUM_PACKETS * blast.PACKET_SAMPLES].astype(np.float32) / 32768
    items = [LoadItem("utt000", audio)]
    level, run = blast.measure_level_blast(server.port, "realtime24k", items, 2, NUM_PACKETS, token=TOKEN, tail_s=20)
    assert not level["errors"] and level["items_completed"] == 2, level["error_examples"]
    assert level["wire_rate"] == 24000 and level["sender"][0]["short_sends"] == 0
    expected, _ = asyncio.run(ws_reference(server, as_pcm16(blast.at_sdk_rate(audio, len(audio))), 24000))
    assert expected and all(r.token_ids == expected for r in run.records)
    for r in run.records:  # the generator's accounting, as load_level fills it: a send time and lateness a packet
        assert len(r.send_times) == len(r.send_lateness) == NUM_PACKETS and r.end_sent and r.final_recv
        assert r.send_ends == [blast.PACKET_SAMPLES * (k + 1) for k in range(NUM_PACKETS)]
        due = np.array(r.send_times) - np.array(r.send_lateness)  # each packet's slot in the real-time schedule
        assert all(x >= 0 for x in r.send_lateness) and np.allclose(np.diff(due), 0.02, atol=1e-5)
    assert [w["packets"] for w in level["workers"]] == [2 * NUM_PACKETS]
    assert level["send_lateness_ms"]["p99"] is not None

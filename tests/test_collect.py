"""Collect's array shortcuts (engine/collect.py) against what they stand for."""

from __future__ import annotations

import numpy as np

from . import helpers


def test_update_arrival_is_the_packet_holding_the_last_sample_read():
    """Each update's arrival time, taken from the intake's last-packet arrays where they answer,
    is the arrival of the packet holding the last sample its chunk read (AudioBuffer.arrival_time's
    definition), on packets of random sizes, some shorter than a chunk, some several chunks long,
    and a slot reused by a second stream."""
    m = helpers.model(context_right=0)  # 80 ms chunks: many rows
    engine = helpers.bare_engine(m, num_slots=3)
    hop, margin = m.geometry.hop_samples, engine.features.margin
    rng = np.random.default_rng(46)
    answered = []
    arrivals = engine.last_packet.arrivals

    def spy(slots, ends):
        times, known = arrivals(slots, ends)
        answered.extend(known)
        return times, known

    engine.last_packet.arrivals = spy
    audio = np.concatenate(helpers.utterances(2, seed=5))[: 16000 * 4]
    clock = [1000.0]
    for round_ in range(2):  # the second round reuses slots 0 and 1
        streams = [engine.admit(slot=slot, stream_id=f"s{round_}{slot}") for slot in (0, 1)]
        packets = {s.stream_id: [] for s in streams}  # (end sample, arrival) per packet
        updates = []
        for _ in range(400):
            for s in streams:
                got = packets[s.stream_id][-1][0] if packets[s.stream_id] else 0
                n = int(rng.choice([1, 37, 700, 160, 320, 480, 1280, 1600, 4800]))  # hop multiples: boundaries at chunk ends
                if got >= len(audio):
                    continue
                piece = audio[got : got + n]
                clock[0] += 0.25
                engine.take_audio(s, (piece,), clock[0])
                packets[s.stream_id].append((got + len(piece), clock[0]))
                if got + len(piece) >= len(audio):
                    engine.finish(s)
            updates += engine.iterate().updates
            if not engine.num_open_streams:
                break
        for u in updates:
            if u.is_final:
                continue
            next_frame = round(u.audio_processed_s / engine.hop_s)
            last_read = (next_frame - 1) * hop + margin - 1  # the last sample the chunk read
            ends = [end for end, _ in packets[u.stream_id]]
            expected = packets[u.stream_id][int(np.searchsorted(ends, last_read, side="right"))][1]
            assert u.audio_arrival_time == expected, (u.stream_id, next_frame)
    assert sum(answered) > 20 and not all(answered)  # both the arrays' and the buffers' answers were used
    helpers.assert_engine_empty(engine)

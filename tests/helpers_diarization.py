"""Batched streaming Sortformer against NeMo's own loop, shared by test_diarization_step.py (the tiny
random-weight model on synthetic audio) and test_diarization_demo.py (the shipped demo diarizer on the
bundled conversation): step streams together through the speaker-cache slots, and compare each
stream's probabilities and decisions with NeMo's `forward_streaming_step` loop on that stream alone.
Also the engine-level diarization tests' driver (test_diarization_engine.py, test_diarization_overlap.py)."""

from __future__ import annotations

import numpy as np
import torch

from nemo_serve.diarization import runner as diar_runner
from nemo_serve.diarization.reference import nemo_reference_preds
from nemo_serve.diarization.slots import SpeakerCacheSlots
from nemo_serve.diarization.step import diarize_step, make_batch

from . import helpers

PROB_ATOL = 2e-5  # fp32: padding changes matmul shapes, so the last bits differ (max seen 2.9e-6)
NUM_SLOTS = 2


def run_batched(model, chunks_per_stream, starts):
    """Step all ready streams together until every stream is done; returns preds per stream and end states."""
    pool = SpeakerCacheSlots.for_model(model, NUM_SLOTS)
    outputs = {i: [] for i in range(len(chunks_per_stream))}
    next_chunk, end_states, step = {}, {}, 0
    waiting = list(range(len(chunks_per_stream)))
    while waiting or next_chunk:
        for i in [i for i in waiting if starts[i] <= step]:
            if not pool.num_free:
                break
            pool.acquire(f"s{i}")
            next_chunk[i] = 0
            waiting.remove(i)
        ready = sorted(next_chunk)
        if not ready:  # every started stream is done and the next may not start yet
            step += 1
            continue
        slots = [pool.stream_to_slot[f"s{i}"] for i in ready]
        batch = make_batch(slots, [chunks_per_stream[i][next_chunk[i]] for i in ready])
        result = diarize_step(model, pool, batch)
        assert not pool.problems()  # the host's fill levels (the step's widths and branches) = the device's
        for row, i in enumerate(ready):
            outputs[i].append(result.chunk_preds[row, : int(result.chunk_lengths[row])])
            next_chunk[i] += 1
            if next_chunk[i] == len(chunks_per_stream[i]):
                end_states[i] = pool.gather(torch.tensor([slots[row]]))
                pool.release(f"s{i}")
                del next_chunk[i]
        step += 1
    assert pool.num_used == 0 and pool.num_free == NUM_SLOTS
    return [torch.cat(outputs[i]) for i in range(len(chunks_per_stream))], end_states


def assert_matches_nemo_loop(model, chunks_per_stream, ours, end_states, setting: str) -> list[torch.Tensor]:
    """Each stream's probabilities within PROB_ATOL of NeMo's loop on it alone, identical decisions
    (p > 0.5, argmax), and the test exercised what it claims: the speaker cache filled and was
    compressed, silence was seen. Returns NeMo's probabilities per stream."""
    reference = []
    for i, stream_chunks in enumerate(chunks_per_stream):
        theirs = nemo_reference_preds(model, stream_chunks)
        assert ours[i].shape == theirs.shape, (i, ours[i].shape, theirs.shape)
        max_diff = (ours[i] - theirs).abs().max().item()
        print(f"{setting} stream {i}: max |p - p_nemo| = {max_diff:.2e}")
        assert max_diff <= PROB_ATOL, (setting, i, max_diff)
        assert torch.equal(ours[i] > 0.5, theirs > 0.5), (setting, i)
        assert torch.equal(ours[i].argmax(dim=1), theirs.argmax(dim=1)), (setting, i)
        state = end_states[i]
        assert int(state.spkcache_lengths) == model.sortformer_modules.spkcache_len, (setting, i)
        assert int(state.n_sil_frames) > 0, (setting, i)
        reference.append(theirs)
    return reference


def _kept_probabilities(monkeypatch) -> dict:
    """stream_id -> all its speaker probabilities, as the runner reported them step by step (it
    keeps only the frames still needed)."""
    kept, collect = {}, diar_runner.SortformerRunner.collect

    def keeping(self, launched):
        stream_ids = collect(self, launched)
        for stream_id in stream_ids:
            window, seen = self.streams[stream_id].preds, len(kept.get(stream_id, ()))
            assert window.first_frame <= seen, "frames forgotten before the test saw them"
            new = window.kept()[seen - window.first_frame :]
            kept[stream_id] = np.concatenate([kept.get(stream_id, np.zeros((0, new.shape[1]), np.float32)), new])
        return stream_ids

    monkeypatch.setattr(diar_runner.SortformerRunner, "collect", keeping)
    return kept


def _drive(engine, audios, diarization, packet=1600, start_tick=None):
    """helpers.drive with per-stream `diarization` options; returns (results per stream, stream ids)."""
    results, handles, pos, start_tick = [[] for _ in audios], {}, [0] * len(audios), start_tick or [0] * len(audios)
    for tick in range(100000):
        for i, audio in enumerate(audios):
            if tick == start_tick[i]:
                handles[i] = engine.open_stream(results[i].append, diarization=diarization[i])
            if i in handles and pos[i] < len(audio):
                engine.push(handles[i], audio[pos[i] : pos[i] + packet])
                pos[i] += packet
                if pos[i] >= len(audio):
                    engine.finish(handles[i])
        engine.iterate()
        if all(r and r[-1].done for r in results):
            engine.iterate()
            return results, [handles[i].stream_id for i in range(len(audios))]
    raise AssertionError("streams did not finish")


def _assert_empty(engine) -> None:
    helpers.assert_engine_empty(engine)
    d = engine.engine.diarizer
    assert not d.streams and d.pool.num_used == 0 and not engine.engine.speakers

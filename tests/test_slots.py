"""Slot table (which stream holds which slot) and slot pool (zero on reuse, gather/scatter round trip)."""


import pytest
import torch

from nemo_serve.engine.slot_table import SlotTable
from nemo_serve.engine.slots import EncoderCache, SlotPool

from . import helpers


@pytest.fixture(scope="module")
def m():
    return helpers.model("builtin:tiny-char", 3)


class _Stream:
    def __init__(self, stream_id: str) -> None:
        self.stream_id, self.slot = stream_id, None


def test_given_slots_are_taken_and_given_back():
    """The caller picks the slot (an engine core: the one its front end was given; the in-process
    harness: its lowest free one); the table records who holds it and whether a stream is open."""
    table = SlotTable(3)
    streams = [_Stream(f"s{i}") for i in range(3)]
    for slot, s in zip((2, 0, 1), streams):
        table.take(s, slot)
    assert [s.slot for s in streams] == [2, 0, 1]
    assert table.num_free == 0 and table.held.all() and table.stream_at(0) is streams[1] and table.holds(streams[1])
    table.give_back(streams[1])
    assert table.num_free == 1 and not table.held[0] and not table.holds(streams[1])
    s4 = _Stream("s4")
    table.take(s4, 0)
    assert table.holds(s4) and not table.holds(streams[1])  # its old slot holds another stream now
    assert table.num_free + table.num_used == table.num_slots and not table.problems()


def test_a_given_slot_must_be_free_and_duplicate_ids_rejected():
    table = SlotTable(3)
    a = _Stream("a")
    table.take(a, 2)
    with pytest.raises(ValueError, match="already open"):
        table.take(_Stream("a"), 0)
    with pytest.raises(ValueError, match="not free"):
        table.take(_Stream("b"), 2)
    with pytest.raises(ValueError, match="not free"):
        table.take(_Stream("b"), 3)  # no such slot
    table.give_back(a)
    assert table.num_free == 3 and not table.held[2] and table.stream_at(2) is None and not table.problems()
    table.held[1] = True  # marked held with no stream: the scheduler would plan it
    assert table.problems()


def test_freed_row_is_reset_and_neighbours_untouched(m):
    pool = SlotPool(m, 3)
    a, b = 0, 1
    pool.open_row(a), pool.open_row(b)
    rows = torch.tensor([a, b])
    enc = pool.gather_encoder(rows)
    filled = EncoderCache(
        torch.randn_like(enc.cache_last_channel), torch.randn_like(enc.cache_last_time), torch.tensor([7, 9])
    )
    pool.scatter_encoder(rows, filled)
    dec = pool.gather_decoder(rows)
    dec.predictor_states = [torch.randn_like(s) for s in dec.predictor_states]
    dec.labels = torch.tensor([5, 6])
    dec.decoded_lengths = torch.tensor([11, 12])
    pool.scatter_decoder(rows, dec)
    # Round trip: gather returns exactly what was scattered.
    again = pool.gather_encoder(rows)
    assert torch.equal(again.cache_last_channel, filled.cache_last_channel)
    assert torch.equal(again.cache_last_time, filled.cache_last_time)
    assert pool.gather_decoder(rows).decoded_lengths.tolist() == [11, 12]
    pool.close_row(a)
    assert pool.cache_last_channel[:, a].abs().sum() > 0  # the reset waits for the next step or gather
    pool.flush()  # ... and comes in one batch, without waiting for the device
    assert pool.cache_last_channel[:, a].abs().sum() == 0
    assert pool.cache_last_time[:, a].abs().sum() == 0
    assert pool.cache_last_channel_len[a] == 0
    assert pool.decoded_lengths[a] == 0
    assert pool.labels[a] == m.blank_id  # <SOS> is the blank id
    assert torch.equal(pool.cache_last_channel[:, b], filled.cache_last_channel[:, 1])
    assert pool.decoded_lengths[b] == 12


def test_cache_shapes_follow_model(m):
    """configs/tiny-char.yaml by hand: 2 layers, d_model 64, 56 cached left frames, conv kernel 9 (causal: 8
    cached columns). Per stream: 2 x 56 x 64 = 7,168 + 2 x 64 x 8 = 1,024 floats = 8,192 x 4 B = 32,768 B."""
    pool = SlotPool(m, 4)
    assert pool.scratch == 4  # one more row: the padded rows of a bucketed step point at it
    assert pool.cache_last_channel.shape == (2, 5, 56, 64)  # [L, S+1, C, D]
    assert pool.cache_last_time.shape == (2, 5, 64, 8)  # [L, S+1, D, K-1]
    assert pool.cache_last_channel_len.shape == (5,)
    assert m.cache_bytes_per_stream == pool.cache_bytes_per_stream == 32_768
    assert pool.cache_last_channel.nbytes + pool.cache_last_time.nbytes == 5 * 32_768

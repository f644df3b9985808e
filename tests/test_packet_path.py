"""The front end's per-packet path to the core (issue 48): ring positions coalesced in time, and
the order the core relies on kept (the audio's Wrote before the Finish that ends it)."""

from __future__ import annotations

import asyncio

import numpy as np
import zmq
import zmq.asyncio

from nemo_serve.core import messages as m
from nemo_serve.core.addresses import control_address
from nemo_serve.core.client import WROTE_PERIOD_S, EngineClient
from nemo_serve.core.shared import FileLock, SharedLayout, SharedSlots
from .helpers_ring import ring_model_info


_info = ring_model_info


async def _control_messages(tmp_path, script) -> list:
    """Run `script(client)` against a started EngineClient; the control messages the core got."""
    layout = SharedLayout(num_slots=4, ring_samples=4096)
    shared = SharedSlots.create(layout, FileLock(str(tmp_path / "slots.lock")))
    ctx = zmq.asyncio.Context()
    core = ctx.socket(zmq.PULL)
    core.bind(control_address(str(tmp_path)))
    client = EngineClient(_info(), shared, 0, str(tmp_path)).start()
    try:
        await script(client)
        await asyncio.sleep(WROTE_PERIOD_S * 5)
        got = []
        while await core.poll(200):
            got.append(m.control_decoder.decode(await core.recv()))
        return got
    finally:
        client.stop()
        core.close(0)
        ctx.term()
        shared.close()


def _ends(w: m.Wrote) -> dict[int, int]:
    return dict(zip(np.frombuffer(w.slots, m.SLOT).tolist(), np.frombuffer(w.ends, m.POS).tolist()))


def test_rings_written_within_the_period_share_one_wrote(tmp_path):
    """Packets of two streams in three event-loop ticks: the first is announced at the end of its
    tick, the next two (within WROTE_PERIOD_S of it) together in one Wrote with both rings' ends."""
    samples = np.ones(160, np.float32)

    async def script(client):
        a, b = client.open_stream(lambda r: None), client.open_stream(lambda r: None)
        client.push(a, samples)
        await asyncio.sleep(0)  # a tick ends: its Wrote goes
        client.push(a, samples)
        await asyncio.sleep(0)
        client.push(b, samples)
        script.slots = (a.slot, b.slot)

    msgs = asyncio.run(_control_messages(tmp_path, script))
    wrotes = [x for x in msgs if isinstance(x, m.Wrote)]
    a, b = script.slots
    assert [_ends(w) for w in wrotes] == [{a: 160}, {a: 320, b: 160}], msgs


def test_a_finish_follows_the_wrote_of_its_stream_audio(tmp_path):
    """A Finish while a Wrote waits for its period: the Wrote goes first, with the audio's end."""
    samples = np.ones(160, np.float32)

    async def script(client):
        h = client.open_stream(lambda r: None)
        client.push(h, samples)
        await asyncio.sleep(0)
        client.push(h, samples)  # its Wrote deferred (within the period)
        client.finish(h)
        script.slot = h.slot

    msgs = asyncio.run(_control_messages(tmp_path, script))
    kinds = [type(x).__name__ for x in msgs]
    assert kinds == ["Open", "Wrote", "Wrote", "Finish"], kinds
    assert _ends(msgs[2]) == {script.slot: 320}


def test_control_messages_reach_the_core_in_order(tmp_path):
    """Open, Wrote, ForceFinal, Abort in the order sent (through the socket's plain view)."""

    async def script(client):
        h = client.open_stream(lambda r: None)
        client.push(h, np.ones(160, np.float32))
        client.force_final(h)
        client.abort(h, "test")

    kinds = [type(x).__name__ for x in asyncio.run(_control_messages(tmp_path, script))]
    assert kinds == ["Open", "Wrote", "ForceFinal", "Abort"], kinds


def _parsed(parse, text: str):
    from nemo_serve.server.realtime_protocol import RealtimeError

    try:
        return parse(text)
    except RealtimeError as e:
        return ("error", str(e), e.code, e.param, e.event_id)


def test_append_fast_path_parses_as_the_general_path():
    """Appends (and near-appends) through parse_client_event equal the general JSON + base64 path:
    the same Append, or the same error, for valid, badly padded and foreign base64, odd byte
    counts, every event_id and runtime_config shape, and duplicate keys."""
    import base64
    import json
    import random

    from nemo_serve.server.realtime_parse import parse_client_event, parse_client_event_generally

    rng = random.Random(48)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="
    audios = [base64.b64encode(rng.randbytes(n)).decode() for n in (0, 1, 2, 3, 960, 961)]
    audios += ["".join(rng.choice(alphabet + " -_\n") for _ in range(rng.randint(0, 12))) for _ in range(400)]
    audios += ["QUFB=", "QQ", "QUE=", None, 5, ["QUE="]]
    extras = [{}, {"event_id": "e1"}, {"event_id": "x" * 200}, {"event_id": 7}, {"runtime_config": {"force_eou": "true"}},
              {"runtime_config": {"force_eou": True}}, {"runtime_config": "true"}, {"runtime_config": {"force_eou": "no"}},
              {"future": [1, {"a": None}]}]  # fmt: skip
    texts = []
    for audio in audios:
        extra = rng.choice(extras)
        texts.append(json.dumps({"type": "input_audio_buffer.append", "audio": audio, **extra}))
    texts += ['{"type": "input_audio_buffer.append", "audio": "QUE=", "type": "input_audio_buffer.commit"}',
              '{"type": "input_audio_buffer.commit", "audio": "QUE=", "type": "input_audio_buffer.append"}',
              '{"type": "input_audio_buffer.append"}', '{"audio": "QUE="}', '[1]', 'nope', '{"type": "input_audio_buffer.append", '
              '"audio": "QUE=", "event_id": "\\ud800"}', '{"type": "input_audio_buffer.append", "audio": "QUE=", "n": NaN}']  # fmt: skip
    differ = [t for t in texts if _parsed(parse_client_event, t) != _parsed(parse_client_event_generally, t)]
    assert not differ, differ[:3]
    assert _parsed(parse_client_event, texts[4]) != _parsed(parse_client_event, texts[5])  # the corpus tells appends apart

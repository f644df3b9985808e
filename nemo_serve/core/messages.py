"""Messages between the processes, as msgspec structs encoded with msgpack.

Control (front ends and supervisor -> core, one ZMQ PULL socket): a handful per stream, and, where
ring positions travel in messages (shared.py), one `Wrote` per event-loop tick in which a front end
wrote audio, at most one per client.WROTE_PERIOD_S; where they live in shared memory, a `Wake`
only to a core that sleeps. Results (core -> one front end, a PUSH socket per front end): one message
per loop iteration holding every StreamUpdate of that front end's streams and how far the core has
read their rings. Audio does not travel here: it goes through the shared-memory rings (shared.py);
these messages publish the ring positions, which is
what makes the rings correct on any CPU (shared.py says why).

Why pyzmq + msgspec (as vLLM's engine core uses them): ZMQ sockets are message-framed,
many-to-one without a broker, never block the sender on a slow peer, and survive a peer that
dies; msgspec encodes these structs in about a microsecond, and refuses malformed ones.
"""

from __future__ import annotations

import msgspec
import numpy as np

from ..engine.results import StreamUpdate


class Open(msgspec.Struct, tag=True, array_like=True):
    slot: int
    gen: int
    frontend: int
    stream_id: str
    language_index: int
    endpoint: dict  # EndpointConfig's fields
    context_right: int | None = None  # the stream's chunk mode (None: the default)
    phrases: list[str] | None = None  # boosted phrases, checked by the front end (engine/phrases.py)
    boost: float | None = None
    diarization: dict | None = None  # {"max_speakers": N}: speakers on its results (engine/speakers.py)


class Wrote(msgspec.Struct, tag=True, array_like=True):
    """Front end: these slots' rings hold their streams' samples up to `ends`. Sent after the
    samples are written (their publication: shared.py); one message for every ring written in an
    event-loop tick, as raw little-endian arrays so the core applies them with array operations."""

    slots: bytes  # int32[n]
    gens: bytes  # int64[n]: the stream's slot generation (a late one for a reused slot is ignored)
    ends: bytes  # int64[n]: samples written since the stream opened
    arrivals: bytes  # float64[n]: time.time() when the newest of them arrived


class Wake(msgspec.Struct, tag=True, array_like=True):
    """Front end, ring positions in shared memory: new audio for a core that said it sleeps
    (shared.py, the wake-up); the core's next look at the positions finds it."""


class Finish(msgspec.Struct, tag=True, array_like=True):
    slot: int
    gen: int


class ForceFinal(msgspec.Struct, tag=True, array_like=True):
    slot: int
    gen: int
    at_sample: int | None = None  # end after the whole chunks before it (engine/forced_ends.py); None: now


class Abort(msgspec.Struct, tag=True, array_like=True):
    slot: int
    gen: int
    reason: str


class FrontendGone(msgspec.Struct, tag=True, array_like=True):
    """Supervisor: this front end died; abort its streams and free its slots."""

    frontend: int


class Stop(msgspec.Struct, tag=True, array_like=True):
    """Supervisor: every front end has drained; exit."""


Control = Open | Wrote | Wake | Finish | ForceFinal | Abort | FrontendGone | Stop


class Results(msgspec.Struct, array_like=True):
    """Core -> one front end, once per loop iteration that has news for it."""

    updates: list[StreamUpdate]
    slots: bytes  # int32[n]: rings the core has read from in this iteration
    gens: bytes  # int64[n]
    read_ends: bytes  # int64[n]: samples read since the stream opened; the space before is free

control_encoder = msgspec.msgpack.Encoder()
control_decoder = msgspec.msgpack.Decoder(Control)
results_decoder = msgspec.msgpack.Decoder(Results)

SLOT, GEN, POS, TIME = np.dtype("<i4"), np.dtype("<i8"), np.dtype("<i8"), np.dtype("<f8")  # the arrays' wire types

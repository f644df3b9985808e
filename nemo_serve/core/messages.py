"""Messages between the processes, as msgspec structs encoded with msgpack.

Control (front ends and supervisor -> core, one ZMQ PULL socket): small and rare, a handful
per stream. Results (core -> one front end, a PUSH socket per front end): one message per loop
iteration holding every StreamUpdate of that front end's streams. Audio does not travel here:
it goes through the shared-memory rings (shared.py).

Why pyzmq + msgspec (as vLLM's engine core uses them): ZMQ sockets are message-framed,
many-to-one without a broker, never block the sender on a slow peer, and survive a peer that
dies; msgspec encodes these structs in about a microsecond, and refuses malformed ones.
"""

from __future__ import annotations

import msgspec

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


class Finish(msgspec.Struct, tag=True, array_like=True):
    slot: int
    gen: int


class ForceFinal(msgspec.Struct, tag=True, array_like=True):
    slot: int
    gen: int


class Abort(msgspec.Struct, tag=True, array_like=True):
    slot: int
    gen: int
    reason: str


class FrontendGone(msgspec.Struct, tag=True, array_like=True):
    """Supervisor: this front end died; abort its streams and free its slots."""

    frontend: int


class Stop(msgspec.Struct, tag=True, array_like=True):
    """Supervisor: every front end has drained; exit."""


Control = Open | Finish | ForceFinal | Abort | FrontendGone | Stop

control_encoder = msgspec.msgpack.Encoder()
control_decoder = msgspec.msgpack.Decoder(Control)
updates_decoder = msgspec.msgpack.Decoder(list[StreamUpdate])

"""What a WebSocket wire format (ws_format.py for /ws, realtime.py for /v1/realtime,
deepgram_live.py for /v1/listen) hands the one WebSocket transport (ws_socket.py): named here so
that the formats need not import the transport, which imports them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..engine.results import StreamResult
from .stream_session import StreamSession


@dataclass
class Rendered:
    """An engine result as frames, and whether the socket then closes (1000 with `close`: the
    reason, "" for none); `observed`: the result's latency counts (a frame carried it)."""

    frames: list[str]
    observed: bool = False
    close: str | None = None


@dataclass
class NormalClose:
    """Outbox item: close 1000 with `reason` once what was queued before it is sent (a realtime
    session whose input ended with no item left to decode)."""

    reason: str


class WireFormat(Protocol):
    """One WebSocket protocol over its `session`. ProtocolError or AudioError raised by on_text /
    on_bytes fail the stream."""

    session: StreamSession
    config_error: str | None  # a bad URL parameter: refused with 1008 before any frame is read

    def on_text(self, text: str) -> None: ...

    def on_bytes(self, data: bytes) -> None: ...

    def render(self, r: StreamResult) -> Rendered: ...

    def error_frame(self, reason: str, code: int) -> str:
        """The text frame sent before a failure's close with `code`."""

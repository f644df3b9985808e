"""The stub /ws server that loadgen_capacity.py drives: no model, no engine, one `partial` per packet.

It answers the config with `ready` (the level's chunk_ms), reads every binary packet and sends one
`partial` per packet (as the engine does per chunk: audio processed, arrival and send times, so the
load generator's readers and the DESIGN's keeps-up rule apply unchanged), and `final` + `done` at
`end`. Two implementations of the same replies:
  - "websockets": websockets' asyncio server on uvloop (the stub of the first capacity runs);
  - "picows": picows's frame callback on uvloop, no task or queue per connection. The blast sender
    costs a few µs a packet, so against the websockets stub (tens of µs a packet) the stub, not
    the sender, would be the first to run out of CPU at thousands of streams on a 2-core machine.
One process, or several on one port (SO_REUSEPORT: the kernel spreads the connections) where one
core would not carry the level; their CPU is read from /proc by the caller (`cpu_s`) so a level
can say whether the stub kept up.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from benchmarks.common import SAMPLE_RATE

STUBS = ("websockets", "picows")
COMPACT = (",", ":")  # as the server writes them: blast's early exit looks for '"type":"done"'


def partial_message(samples: int) -> str:
    now = time.time()
    processed = max(0.0, samples / SAMPLE_RATE - 0.01)
    return json.dumps({"type": "partial", "text": "", "audio_processed": processed,
                       "audio_arrival_time": now, "sent_time": now}, separators=COMPACT)  # fmt: skip


FINAL = json.dumps({"type": "final", "text": "", "token_ids": []}, separators=COMPACT)
DONE = json.dumps({"type": "done"}, separators=COMPACT)


async def _websockets_session(ws, chunk_ms: float) -> None:
    await ws.recv()  # config
    await ws.send(json.dumps({"type": "ready", "chunk_ms": chunk_ms}, separators=COMPACT))
    samples = 0
    async for msg in ws:
        if isinstance(msg, bytes):
            samples += len(msg) // 4  # float32
            await ws.send(partial_message(samples))
        elif json.loads(msg).get("type") == "end":
            await ws.send(FINAL)
            await ws.send(DONE)
            return


async def _serve_websockets(port: int, chunk_ms: float) -> None:
    from websockets.asyncio.server import serve

    async with serve(lambda ws: _websockets_session(ws, chunk_ms), "127.0.0.1", port, max_size=None, compression=None,
                     reuse_port=True):  # fmt: skip
        await asyncio.Future()


async def _serve_picows(port: int, chunk_ms: float) -> None:
    from picows import WSListener, WSMsgType, ws_create_server

    ready = json.dumps({"type": "ready", "chunk_ms": chunk_ms}, separators=COMPACT).encode()

    class Session(WSListener):
        """One stream: the first text frame is the config, any later one its `end`."""

        def on_ws_connected(self, transport) -> None:
            self.samples, self.configured = 0, False

        def on_ws_frame(self, transport, frame) -> None:
            kind = frame.msg_type
            if kind == WSMsgType.BINARY:
                self.samples += frame.payload_size // 4  # float32
                transport.send(WSMsgType.TEXT, partial_message(self.samples).encode())
            elif kind == WSMsgType.TEXT and not self.configured:
                self.configured = True
                transport.send(WSMsgType.TEXT, ready)
            elif kind == WSMsgType.TEXT and json.loads(frame.get_payload_as_bytes()).get("type") == "end":
                transport.send(WSMsgType.TEXT, FINAL.encode())
                transport.send(WSMsgType.TEXT, DONE.encode())
            elif kind == WSMsgType.CLOSE:
                transport.send_close(frame.get_close_code())
                transport.disconnect()

    server = await ws_create_server(lambda request: Session(), "127.0.0.1", port, max_frame_size=1 << 20,
                                    enable_auto_ping=False, websocket_handshake_timeout=60, reuse_port=True)  # fmt: skip
    await server.serve_forever()


def serve(stub: str, port: int, chunk_ms: float) -> None:
    """Runs forever (the caller terminates the process)."""
    import uvloop

    from benchmarks.load_workers import ensure_fd_limit

    ensure_fd_limit(int(os.environ.get("LOADGEN_STUB_STREAMS", "10000")))
    uvloop.run((_serve_picows if stub == "picows" else _serve_websockets)(port, chunk_ms))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/<pid>/stat, fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

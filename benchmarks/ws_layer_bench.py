"""The WebSocket layer's own CPU per paced packet, candidate by candidate, side by side (issue 48).

    PYTHONPATH=.:/tmp/f48b_pkgs python benchmarks/ws_layer_bench.py --out benchmarks/results/ws_layer_cpu.json

benchmarks/packet_cost.py measures the whole front end; this isolates the part a different
WebSocket server would change. Every candidate serves the same trivial app (count the binary
frame, send a small JSON text every RESULT_EVERY packets, as the real server sends a partial about
every 16 packets of 20 ms: packet_cost_cpu.json) in its own process; the same paced client (the
streams spread over each 20 ms, as independent clients are) sends 20 ms PCM16 frames through real
sockets; the server process tree's CPU over the window (from /proc, its idle rate subtracted) over
the packets sent is the figure. Candidates are alternated repeat by repeat (this machine's load
drifts: side by side is the only fair comparison):

  uvicorn_sansio_uvloop    uvicorn + websockets sans-I/O + uvloop: what the server runs today
  uvicorn_sansio_asyncio   the same on asyncio's own loop (uvloop off)
  uvicorn_wsproto_uvloop   uvicorn + wsproto
  granian_uvloop           granian (Rust HTTP/WebSocket, ASGI), one worker
  picows_uvloop            picows (Cython WebSocket on asyncio's protocol API), frames handled in its callback
  picows_queue_uvloop      picows, each frame handed to a per-connection task through an asyncio.Queue,
                           as a session's receive loop would take it (what keeping the sessions costs)
  picows_asyncio           picows on asyncio's own loop

--decode also times an append's JSON + base64 decode in-process (stdlib, msgspec as the server
does today, orjson + pybase64) for /v1/realtime. A candidate whose package is missing is skipped
and named in the result.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.layer_bench import (PACKET_S, RESULT_EVERY, Candidate, alternate, arguments, importable,  # noqa: E402
                                    installed_versions, paced_window)  # fmt: skip
from benchmarks.raw_ws import Conn, frame  # noqa: E402
from benchmarks.server_process import children, cpu_s  # noqa: E402

READY = b'{"type":"ready"}'
RESULT = b'{"type":"partial","text":"' + b"x" * 120 + b'","segment":0,"start_ms":0,"end_ms":1200}'
CANDIDATES = ("uvicorn_sansio_uvloop", "uvicorn_sansio_asyncio", "uvicorn_wsproto_uvloop", "granian_uvloop",
              "picows_uvloop", "picows_queue_uvloop", "picows_asyncio")  # fmt: skip
NEEDS = {"uvicorn_wsproto_uvloop": "wsproto", "granian_uvloop": "granian", "picows_uvloop": "picows",
         "picows_queue_uvloop": "picows", "picows_asyncio": "picows"}  # fmt: skip


# ----------------------------------------------------------------------------- servers


async def asgi_app(scope, receive, send) -> None:
    """The trivial app every ASGI candidate serves."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["type"] != "websocket":
        return
    await receive()  # websocket.connect
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": READY.decode()})
    n = 0
    while (await receive())["type"] == "websocket.receive":
        n += 1
        if n % RESULT_EVERY == 0:
            await send({"type": "websocket.send", "text": RESULT.decode()})


def serve_uvicorn(port: int, ws: str, loop: str) -> None:
    import uvicorn

    uvicorn.run(asgi_app, host="127.0.0.1", port=port, ws=ws, loop=loop, http="httptools", log_level="warning",
                ws_per_message_deflate=False, ws_ping_interval=None, lifespan="on")  # fmt: skip


def serve_granian(port: int) -> None:
    from granian import Granian

    Granian("benchmarks.ws_layer_bench:asgi_app", address="127.0.0.1", port=port, interface="asgi", workers=1,
            loop="uvloop", websockets=True, log_enabled=False).serve()  # fmt: skip


def serve_picows(port: int, queued: bool, use_uvloop: bool) -> None:
    from picows import WSListener, WSMsgType, ws_create_server

    class Counter(WSListener):
        """Counts frames in picows's callback: no task, no queue."""

        def on_ws_connected(self, transport) -> None:
            self.n = 0
            transport.send(WSMsgType.TEXT, READY)

        def on_ws_frame(self, transport, frame) -> None:
            if frame.msg_type == WSMsgType.CLOSE:
                transport.send_close(frame.get_close_code())
                transport.disconnect()
            elif frame.msg_type == WSMsgType.BINARY:
                self.handle(transport, frame.get_payload_as_bytes())

        def handle(self, transport, data: bytes) -> None:
            self.n += 1
            if self.n % RESULT_EVERY == 0:
                transport.send(WSMsgType.TEXT, RESULT)

    class Queued(Counter):
        """Hands each frame to a per-connection task, as a session's receive loop would."""

        def on_ws_connected(self, transport) -> None:
            super().on_ws_connected(transport)
            self.queue: asyncio.Queue = asyncio.Queue()
            self.task = asyncio.get_running_loop().create_task(self.receive_loop(transport))

        def on_ws_disconnected(self, transport) -> None:
            self.task.cancel()

        def handle(self, transport, data: bytes) -> None:
            self.queue.put_nowait(data)

        async def receive_loop(self, transport) -> None:
            while True:
                await self.queue.get()
                Counter.handle(self, transport, b"")

    async def main() -> None:
        listener = Queued if queued else Counter
        server = await ws_create_server(lambda request: listener(), "127.0.0.1", port,
                                        max_frame_size=1 << 20, enable_auto_ping=False)  # fmt: skip
        await server.serve_forever()

    if use_uvloop:
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


def serve(name: str, port: int) -> None:
    if name.startswith("uvicorn_"):
        _, ws, loop = name.split("_")
        serve_uvicorn(port, {"sansio": "websockets-sansio", "wsproto": "wsproto"}[ws], loop)
    elif name == "granian_uvloop":
        serve_granian(port)
    else:
        serve_picows(port, queued="queue" in name, use_uvloop=name.endswith("uvloop"))


# ----------------------------------------------------------------------------- client


def tree_cpu_s(pid: int) -> float:
    """CPU of a process and all its descendants (granian's workers), every thread included."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += cpu_s(p)
            todo.extend(children(p))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


async def paced(port: int, n: int, seconds: float, pid: int) -> dict:
    conns = [Conn() for _ in range(n)]
    for c in conns:
        await c.open(port, "/ws", b"", "ready")
    await asyncio.wait_for(asyncio.gather(*(c.ready.wait() for c in conns)), 30)
    packet = frame(np.random.default_rng(0).integers(-3000, 3000, int(16000 * PACKET_S), np.int16).tobytes(), 0x2)
    await asyncio.sleep(0.5)
    r = await paced_window(lambda: tree_cpu_s(pid), n, seconds, lambda i, tick: conns[i].write(packet),
                           lambda: sum(sum(c.counts.values()) for c in conns))  # fmt: skip
    for c in conns:
        c.close()
    await asyncio.sleep(0.3)
    return r


# ----------------------------------------------------------------------------- realtime decode


def decode_costs(number: int = 20000) -> dict:
    """µs per input_audio_buffer.append of 20 ms at 24 kHz (1,280 base64 characters), per decoder."""
    import base64
    import json
    import timeit

    pcm = np.random.default_rng(0).integers(-3000, 3000, 480, np.int16).tobytes()
    text = json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
    from nemo_serve.server.realtime_parse import parse_client_event

    ways = {"stdlib json + base64": lambda: base64.b64decode(json.loads(text)["audio"], validate=True),
            "msgspec (server today: parse_client_event)": lambda: parse_client_event(text)}  # fmt: skip
    try:
        import orjson
        import pybase64

        ways["orjson + pybase64"] = lambda: pybase64.b64decode(orjson.loads(text)["audio"], validate=True)
    except ImportError:
        pass
    return {name: round(1e6 * min(timeit.repeat(f, number=number, repeat=5)) / number, 2) for name, f in ways.items()}


def main() -> None:
    p = arguments(__doc__, CANDIDATES)
    p.add_argument("--decode", action="store_true")
    p.add_argument("--notes", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return
    from benchmarks.common import run_record, write_json

    record = run_record()
    record["notes"] = args.notes
    names, missing = importable(args.candidates, lambda name: NEEDS.get(name, "uvicorn"))
    rows = alternate(lambda name: Candidate(name, args.idle_s, __file__, paced, tree_cpu_s, 24), names, args)
    result = {"run": record, "streams": args.streams, "seconds": args.seconds, "packet_ms": 1000 * PACKET_S,
              "result_every_packets": RESULT_EVERY, "candidates": rows, "skipped": missing,
              "versions": installed_versions(("uvicorn", "websockets", "wsproto", "granian", "picows", "uvloop",
                                              "msgspec", "orjson", "pybase64"))}  # fmt: skip
    if args.decode:
        result["realtime_append_decode_us"] = decode_costs()
    print({k: v["us_per_packet_median"] for k, v in rows.items()}, result.get("realtime_append_decode_us"))
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

"""The gRPC layer's own CPU per paced packet, candidate by candidate, side by side (issue 48).

    PYTHONPATH=.:/tmp/grpcfast_pkgs python benchmarks/grpc_layer_bench.py --out benchmarks/results/grpc_layer_cpu.json

benchmarks/packet_cost.py measures the whole front end; this isolates the part a different gRPC
server changes, as ws_layer_bench.py does for WebSocket servers. Every candidate serves the same
trivial StreamingRecognize (parse each request, send a small StreamingRecognizeResponse every
RESULT_EVERY packets, as the real server sends a partial about every 16 packets of 20 ms) in its
own process on uvloop; the same paced grpc.aio client (the streams spread over each 20 ms, on one
channel, as packet_cost.py's) sends 20 ms PCM16 requests; the server process's CPU over the window
(from /proc, its idle rate subtracted) over the packets sent is the figure. Candidates alternate
repeat by repeat:

  grpc_aio     grpc.aio (grpcio): what --grpc-port runs
  grpclib      grpclib (pure-Python gRPC on the h2 package)
  fast_grpc    server/grpc_h2.py + fast_grpc.py: our HTTP/2 on an asyncio Protocol (--fast-grpc-port)

A candidate whose package is missing is skipped and named in the result.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.raw_ws import send_spread  # noqa: E402
from benchmarks.server_process import cpu_s, free_port  # noqa: E402

PACKET_S = 0.02
RESULT_EVERY = 16
CANDIDATES = ("grpc_aio", "grpclib", "fast_grpc")
NEEDS = {"grpc_aio": "grpc", "grpclib": "grpclib", "fast_grpc": "hpack"}
PATH = "/nvidia.riva.asr.RivaSpeechRecognition/StreamingRecognize"


def _pb():
    from nemo_serve.server.riva_protos import load

    return load()[0]


def _response(pb):
    alt = pb.SpeechRecognitionAlternative(transcript="x" * 60)
    return pb.StreamingRecognizeResponse(results=[pb.StreamingRecognitionResult(alternatives=[alt], channel_tag=1)])


# ----------------------------------------------------------------------------- servers


def serve_grpc_aio(port: int) -> None:
    import grpc

    pb = _pb()
    response = _response(pb)

    async def streaming(_, context):
        n = 0
        while (await context.read()) is not grpc.aio.EOF:
            n += 1
            if n % RESULT_EVERY == 0:
                await context.write(response)

    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(streaming, pb.StreamingRecognizeRequest.FromString,
                                                        pb.StreamingRecognizeResponse.SerializeToString)  # fmt: skip
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "nvidia.riva.asr.RivaSpeechRecognition", {"StreamingRecognize": handler}),))  # fmt: skip
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    import uvloop

    uvloop.run(main())


def serve_grpclib(port: int) -> None:
    from grpclib.const import Cardinality, Handler
    from grpclib.server import Server

    pb = _pb()
    response = _response(pb)

    class Service:
        async def streaming(self, stream) -> None:
            n = 0
            async for _ in stream:
                n += 1
                if n % RESULT_EVERY == 0:
                    await stream.send_message(response)

        def __mapping__(self):
            return {PATH: Handler(self.streaming, Cardinality.STREAM_STREAM, pb.StreamingRecognizeRequest,
                                  pb.StreamingRecognizeResponse)}  # fmt: skip

    async def main() -> None:
        server = Server([Service()])
        await server.start("127.0.0.1", port)
        await server.wait_closed()

    import uvloop

    uvloop.run(main())


def serve_fast_grpc(port: int) -> None:
    import grpc

    from nemo_serve.server.fast_grpc import FastGrpcServer

    pb = _pb()
    response = _response(pb)

    async def streaming(_, context):
        n = 0
        while (await context.read()) is not grpc.aio.EOF:
            n += 1
            if n % RESULT_EVERY == 0:
                await context.write(response)

    async def main() -> None:
        settings = SimpleNamespace(host="127.0.0.1", fast_grpc_port=port, ssl_certfile=None, max_message_bytes=1 << 20,
                                   header_timeout_s=10.0, ping_interval_s=0, ping_timeout_s=20.0)  # fmt: skip
        server = FastGrpcServer({PATH: (True, streaming, pb.StreamingRecognizeRequest.FromString)}, settings)
        await server.start()
        await asyncio.Event().wait()

    import uvloop

    uvloop.run(main())


# ----------------------------------------------------------------------------- client


async def paced(port: int, n: int, seconds: float, pid: int) -> dict:
    import grpc

    from benchmarks.packet_clients import GrpcConn
    from nemo_serve.server.riva_protos import load

    pb, pb_grpc, _ = load()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.RivaSpeechRecognitionStub(channel)
    conns = [GrpcConn(stub, pb, 16000) for _ in range(n)]
    pcm = np.random.default_rng(0).integers(-3000, 3000, int(16000 * PACKET_S), np.int16).tobytes()
    packet = pb.StreamingRecognizeRequest(audio_content=pcm)
    for c in conns:
        c.write(packet)
    await asyncio.sleep(1.0)
    c0, w0, me0 = cpu_s(pid), time.time(), time.process_time()
    sent, late = await send_spread(n, seconds, PACKET_S, lambda i, tick: conns[i].write(packet))
    await asyncio.sleep(PACKET_S)
    c1, w1, me1 = cpu_s(pid), time.time(), time.process_time()
    received = sum(sum(c.counts.values()) for c in conns)
    errors = [c.error for c in conns if c.error]
    for c in conns:
        c.close()
    await asyncio.sleep(0.3)
    await channel.close()
    return {"packets": sent, "messages_received": received, "server_cpu_s": round(c1 - c0, 4), "wall_s": round(w1 - w0, 3),
            "client_cpu_s": round(me1 - me0, 3), "ticks_late_by_over_one_packet": late, "errors": errors[:2]}  # fmt: skip


class Candidate:
    def __init__(self, name: str, idle_s: float) -> None:
        self.name, self.port = name, free_port()
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", name, "--port", str(self.port)],
                                     cwd=Path(__file__).resolve().parent.parent)  # fmt: skip
        self._wait_port()
        time.sleep(1)
        c0, w0 = cpu_s(self.proc.pid), time.time()
        time.sleep(idle_s)
        self.idle_cores = (cpu_s(self.proc.pid) - c0) / (time.time() - w0)

    def _wait_port(self) -> None:
        import socket

        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not listen on {self.port}")

    def measure(self, streams: int, seconds: float) -> dict:
        r = asyncio.run(paced(self.port, streams, seconds, self.proc.pid))
        busy = r["server_cpu_s"] - self.idle_cores * r["wall_s"]
        r["us_per_packet"] = round(1e6 * busy / max(r["packets"], 1), 1)
        print(f"{self.name:12s} {r['packets']:7d} packets {r['messages_received']:5d} messages "
              f"{r['us_per_packet']:7.1f} us/packet (client {r['client_cpu_s']:.2f} s, late ticks "
              f"{r['ticks_late_by_over_one_packet']}) {r['errors']}", flush=True)  # fmt: skip
        return r

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--candidates", default=",".join(CANDIDATES))
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--idle-s", type=float, default=2.0)
    p.add_argument("--notes", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.serve:
        {"grpc_aio": serve_grpc_aio, "grpclib": serve_grpclib, "fast_grpc": serve_fast_grpc}[args.serve](args.port)
        return
    from benchmarks.common import run_record, write_json

    record = run_record()
    record["notes"] = args.notes
    names, missing = [], {}
    for name in args.candidates.split(","):
        try:
            __import__(NEEDS[name])
            names.append(name)
        except ImportError as e:
            missing[name] = str(e)
    cands = [Candidate(n, args.idle_s) for n in names]
    rows: dict = {c.name: {"idle_cores": round(c.idle_cores, 4), "repeats": []} for c in cands}
    try:
        for rep in range(args.repeats):
            for c in cands if rep % 2 == 0 else cands[::-1]:
                rows[c.name]["repeats"].append(c.measure(args.streams, args.seconds))
    finally:
        for c in cands:
            c.stop()
    for row in rows.values():
        row["us_per_packet_median"] = float(np.median([r["us_per_packet"] for r in row["repeats"]]))
    result = {"run": record, "streams": args.streams, "seconds": args.seconds, "packet_ms": 1000 * PACKET_S,
              "result_every_packets": RESULT_EVERY, "candidates": rows, "skipped": missing, "versions": _versions()}  # fmt: skip
    print({k: v["us_per_packet_median"] for k, v in rows.items()})
    if args.out:
        write_json(args.out, result)


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("grpcio", "grpclib", "h2", "hpack", "uvloop", "protobuf"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

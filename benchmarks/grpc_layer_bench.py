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

import asyncio
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.layer_bench import (PACKET_S, RESULT_EVERY, Candidate, alternate, arguments, importable,  # noqa: E402
                                    installed_versions, paced_window)  # fmt: skip
from benchmarks.server_process import cpu_s  # noqa: E402

CANDIDATES = ("grpc_aio", "grpclib", "fast_grpc")
NEEDS = {"grpc_aio": "grpc", "grpclib": "grpclib", "fast_grpc": "hpack"}
PATH = "/nvidia.riva.asr.RivaSpeechRecognition/StreamingRecognize"


def _pb():
    from nemo_serve.server.riva_protos import load

    return load()[0]


def _response(pb):
    alt = pb.SpeechRecognitionAlternative(transcript="x" * 60)
    return pb.StreamingRecognizeResponse(results=[pb.StreamingRecognitionResult(alternatives=[alt], channel_tag=1)])


def _streaming(response):
    """The trivial StreamingRecognize on grpc.aio's handler interface (fast_grpc's too): each
    request read, `response` every RESULT_EVERY."""
    import grpc

    async def streaming(_, context):
        n = 0
        while (await context.read()) is not grpc.aio.EOF:
            n += 1
            if n % RESULT_EVERY == 0:
                await context.write(response)

    return streaming


# ----------------------------------------------------------------------------- servers


def serve_grpc_aio(port: int) -> None:
    import grpc

    pb = _pb()
    streaming = _streaming(_response(pb))

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
    from nemo_serve.server.fast_grpc import FastGrpcServer

    pb = _pb()
    streaming = _streaming(_response(pb))

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
    r = await paced_window(lambda: cpu_s(pid), n, seconds, lambda i, tick: conns[i].write(packet),
                           lambda: sum(sum(c.counts.values()) for c in conns))  # fmt: skip
    r["errors"] = [c.error for c in conns if c.error][:2]
    for c in conns:
        c.close()
    await asyncio.sleep(0.3)
    await channel.close()
    return r


def main() -> None:
    p = arguments(__doc__, CANDIDATES)
    p.add_argument("--notes", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.serve:
        {"grpc_aio": serve_grpc_aio, "grpclib": serve_grpclib, "fast_grpc": serve_fast_grpc}[args.serve](args.port)
        return
    from benchmarks.common import run_record, write_json

    record = run_record()
    record["notes"] = args.notes
    names, missing = importable(args.candidates, NEEDS.__getitem__)
    rows = alternate(lambda name: Candidate(name, args.idle_s, __file__, paced, cpu_s, 12), names, args)
    result = {"run": record, "streams": args.streams, "seconds": args.seconds, "packet_ms": 1000 * PACKET_S,
              "result_every_packets": RESULT_EVERY, "candidates": rows, "skipped": missing,
              "versions": installed_versions(("grpcio", "grpclib", "h2", "hpack", "uvloop", "protobuf"))}  # fmt: skip
    print({k: v["us_per_packet_median"] for k, v in rows.items()})
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

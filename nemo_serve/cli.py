"""`nemo-serve`: start the engine core(s) and the front ends, serve until SIGTERM (or run --selftest N).

Every flag also reads NEMO_SERVE_<NAME> from the environment (config.py). Errors in flags or
in loading the model print one line and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys

from .config import Settings, SettingsError
from .console import configure_logging

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nemo-serve",
        description="Streaming speech recognition server for NeMo cache-aware models (WebSocket).",
        epilog="Every option can also be set as NEMO_SERVE_<OPTION> (e.g. NEMO_SERVE_AUTH_TOKEN).",
    )
    a = p.add_argument
    # Every default is None: config.Settings holds the real defaults and the env fallback.
    m = p.add_argument_group("model and engine")
    m.add_argument("--model", help="a .nemo file, builtin:NAME, or a pretrained name (default: the shipped demo model)")
    m.add_argument("--context-right", metavar="R|R1,R2,...|all",
                   help="chunk mode(s) served: right context r of att_context [L, r], chunk = (r+1) x 80 ms; "
                   "a list (0,13) or all serves several at once, each stream choosing one in its config "
                   "(the first is the default); default: the model's first trained mode")
    m.add_argument("--dtype", choices=["fp32", "bf16"])
    m.add_argument("--device", help="cpu, cuda or cuda:N (default cpu)")
    m.add_argument("--devices", metavar="DEV,DEV,...|all",
                   help="one engine core per device behind the same front ends and port, e.g. cuda:0,cuda:1 "
                   "or all (every GPU); each new stream goes to the core with the most free slots. "
                   "--num-slots is per core")
    m.add_argument("--num-slots", type=int, help="streams served at once (default 16)")
    m.add_argument("--max-batch", type=int, help="most streams in one model step (default: num-slots)")
    m.add_argument("--frontends", type=int,
                   help="WebSocket front-end processes around the engine-core process, at least 1 "
                   "(default: from the CPU count, (cores - 1) // 2, 1 to 8)")
    m.add_argument("--audio-ring-s", type=float,
                   help="shared-memory audio buffer per slot between front ends and core, in s (2)")
    m.add_argument("--no-kv-cache", dest="kv_cache", action="store_const", const=False,
                   help="run NeMo's own attention layers (cache layer inputs, half the memory, slower steps) "
                   "instead of caching projected keys/values")
    m.add_argument("--word-confidence", dest="word_confidence", action="store_const", const=True,
                   help="a confidence per word in finals, from the decoder's scores (costs a softmax per "
                   "emitted token in every step; default off)")
    m.add_argument("--diarizer", metavar="builtin:NAME|FILE.nemo",
                   help="also load a streaming Sortformer diarizer (builtin:tiny-sortformer, or NVIDIA's "
                   "diar_streaming_sortformer .nemo) so streams may ask for speakers (default: none)")
    n = p.add_argument_group("network and security")
    n.add_argument("--host", help="bind address (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    n.add_argument("--port", type=int, help="default 8000")
    n.add_argument("--grpc-port", type=int,
                   help="also serve NVIDIA Riva's ASR gRPC API (StreamingRecognize, Recognize) on this port, "
                   "with the same TLS, token and limits (default: off; needs nvidia-riva-client)")
    n.add_argument("--fast-ws-port", type=int,
                   help="also serve the streaming routes (/ws, /, /v1/realtime) on this port through picows, "
                   "less CPU per packet than --port's uvicorn (default: off; needs picows)")
    n.add_argument("--fast-grpc-port", type=int,
                   help="also serve the Riva gRPC API on this port through the server's own HTTP/2, less "
                   "CPU per packet than --grpc-port's grpc.aio (default: off; needs hpack)")
    n.add_argument("--ssl-certfile", help="TLS certificate (PEM): serves https:// and wss://")
    n.add_argument("--ssl-keyfile", help="TLS private key (PEM)")
    n.add_argument("--auth-token", help="require this bearer token (better: NEMO_SERVE_AUTH_TOKEN)")
    n.add_argument("--allowed-origins", metavar="ORIGINS",
                   help="browser pages allowed to stream besides the server's own: comma-separated "
                   "scheme://host[:port], or '*' (default: same-origin, plus clients that send no Origin)")
    lim = p.add_argument_group("limits")
    lim.add_argument("--max-message-bytes", type=int, help="largest WebSocket message (default 1 MiB)")
    lim.add_argument("--max-file-bytes", type=int, help="largest file POST /v1/audio/transcriptions and /v1/listen take (default 25 MiB)")
    lim.add_argument("--idle-timeout-s", type=float, help="close a stream that sends nothing for this long (30)")
    lim.add_argument("--ping-interval-s", type=float, help="keepalive ping period, 0 = off (20)")
    lim.add_argument("--ping-timeout-s", type=float, help="close when a ping gets no pong in this time (20)")
    lim.add_argument("--max-stream-s", type=float, help="end a stream's input after this much audio or wall time (3600)")
    lim.add_argument("--drain-timeout-s", type=float, help="on SIGTERM, how long open streams get to finish (30)")
    lim.add_argument("--send-timeout-s", type=float,
                     help="close a stream whose client takes no result for this long, freeing its slot (10)")
    lim.add_argument("--header-timeout-s", type=float, help="close a connection whose request (headers, body) takes longer (10)")
    lim.add_argument("--max-connections", type=int, help="open connections, HTTP and WebSocket; more get 503 (1024)")
    lim.add_argument("--max-connections-per-ip", type=int, help="open connections from one address; more get 503 (256)")
    lim.add_argument("--max-queue-delay-s", type=float,
                     help="refuse new streams (503) while the model is this many seconds behind real time "
                          "(overload); 0 = off (2)")
    lim.add_argument("--max-phrases-per-stream", type=int,
                     help="phrases a stream may boost in its config (`phrases`); 0 = boosting off (100)")
    lim.add_argument("--max-phrase-chars", type=int, help="characters per boosted phrase (64)")
    lim.add_argument("--max-phrases-total", type=int,
                     help="boosted phrases of all open streams together; a stream over it is refused (10000)")
    e = p.add_argument_group("endpointing (defaults; each stream may override them)")
    e.add_argument("--endpoint", dest="endpoint", action="store_const", const=True, help="split segments at pauses (default)")
    e.add_argument("--no-endpoint", dest="endpoint", action="store_const", const=False, help="one segment per stream")
    e.add_argument("--rule1-min-trailing-silence", type=float, help="s of silence, with or without text (2.4)")
    e.add_argument("--rule2-min-trailing-silence", type=float, help="s of silence after text (1.2)")
    e.add_argument("--rule3-min-utterance-length", type=float, help="longest segment in s (20)")
    a("--default-encoding", choices=["pcm_f32le", "pcm_s16le"],
      help="encoding of a stream that names none in a config or ?encoding= (default pcm_f32le, sherpa-onnx's)")
    a("--heap-trim-period-s", type=float,
      help="a front end hands freed heap back to the OS (glibc malloc_trim) this often, when idle; 0 = off (60)")
    a("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    s = p.add_argument_group("self-test (parity with NeMo's own streaming loop; no server)")
    s.add_argument("--selftest", type=int, metavar="N", help="stream N utterances through the engine and compare")
    s.add_argument("--audio", help="directory of WAV files or a NeMo manifest for --selftest")
    s.add_argument("--json", dest="json_path", metavar="FILE", help="write the self-test report here")
    s.add_argument("--seed", type=int, help="seed for --selftest's synthetic audio")
    return p


def _fail(msg: str) -> int:
    print(f"nemo-serve: error: {msg}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    flags = vars(args)
    try:
        settings = Settings.from_sources(flags)
    except SettingsError as e:
        return _fail(str(e))
    configure_logging(settings.log_level, nemo=args.selftest is not None)  # serving: NeMo loads in the cores only
    if args.selftest is not None:
        return _selftest(args, settings)
    return _serve(settings)


def _selftest(args, settings: Settings) -> int:
    from . import selftest

    kwargs = dict(
        n=args.selftest,
        model=settings.model,
        context_right=settings.context_right,
        dtype=settings.dtype,
        device=settings.device,
        audio=args.audio,
        json_path=args.json_path,
        # Only when given: the self-test picks its own slot count otherwise.
        num_slots=settings.num_slots if "num_slots" in settings.model_fields_set else None,
        max_batch=settings.max_batch,
        kv_cache=settings.kv_cache,
    )
    if args.seed is not None:
        kwargs["seed"] = args.seed
    return int(selftest.run_selftest(**kwargs))


def _serve(settings: Settings) -> int:
    """The supervisor, its engine-core process(es) and front ends (core/supervisor.py). This
    process imports no NeMo: a plain exit is quick."""
    from .core.supervisor import default_frontends, run_server

    if settings.grpc_port is not None or settings.fast_grpc_port is not None:  # one line now, not a front end failing at start-up
        from .server.riva_protos import RivaProtosMissing, load

        try:
            load()
        except RivaProtosMissing as e:
            return _fail(str(e))
    return run_server(settings, default_frontends() if settings.frontends is None else settings.frontends)


if __name__ == "__main__":
    sys.exit(main())

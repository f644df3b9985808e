"""Sort a front end's py-spy samples (`py-spy record --format raw`: one collapsed stack a line,
root first, then the count) into where a packet's microseconds go (benchmarks/packet_cost.py).

Two views of the same samples:
  phase      which of the front end's jobs was running: the first frame from the leaf up that
             names one (the session's receive task, the engine client's result task, ...)
  component  what code was running: the innermost frame that is ours or a named library, numpy
             and the standard library's small helpers counted to their caller
py-spy samples Python threads only: C threads (ZMQ's I/O thread) are in the measured CPU, not here.
And the plot of packet_cost.py's result.
"""

from __future__ import annotations

from collections import Counter

PHASES = (  # (function, file substring) -> phase; the first match from the leaf up wins
    (("data_received", "protocols/"), "packet in: transport + WebSocket frames"),
    (("on_ws_frame", "picows_connection.py"), "packet in: transport + WebSocket frames"),
    (("data_received", "grpc_h2.py"), "packet in: transport + HTTP/2 frames"),
    (("_receive_loop", "ws_socket.py"), "packet in: session, decode, ring write"),
    (("_receive", "riva_grpc.py"), "packet in: session, decode, ring write"),
    (("_read", "riva_grpc.py"), "packet in: session, decode, ring write"),
    (("_receive_results", "core/client.py"), "results in: ZMQ, assembly, outbox"),
    (("_send_loop", "ws_socket.py"), "results out: render + send"),
    (("results", "riva_grpc.py"), "results out: render + send"),
    (("StreamingRecognize", "riva_grpc.py"), "results out: render + send"),
    (("_announce_written", "core/client.py"), "ring positions to the core (Wrote)"),
    (("_flush_pending", "core/client.py"), "ring positions to the core (Wrote)"),
)
OTHER_PHASE = "event loop, timers, other"

COMPONENTS = (  # file substring -> component; the innermost frame that matches one wins
    # before "websockets/", which its path holds: uvicorn's WebSocket protocol is not websockets' parser
    ("uvicorn/protocols/websockets/", "WebSocket frames (uvicorn's protocol)"),
    ("websockets/", "WebSocket frames (websockets)"),
    ("picows", "WebSocket frames (picows)"),
    ("server/grpc_h2.py", "HTTP/2 frames (grpc_h2)"),
    ("server/h2_flow.py", "HTTP/2 frames (grpc_h2)"),
    ("server/h2_guards.py", "HTTP/2 frames (grpc_h2)"),
    ("server/grpc_stream.py", "HTTP/2 frames (grpc_h2)"),
    ("server/h2_frames.py", "HTTP/2 frames (grpc_h2)"),
    ("server/fast_grpc.py", "HTTP/2 frames (grpc_h2)"),
    ("hpack/", "HTTP/2 frames (grpc_h2)"),
    ("uvicorn/", "ASGI + uvicorn"),
    ("starlette/", "ASGI + uvicorn"),
    ("httptools", "ASGI + uvicorn"),
    ("base64.py", "base64"),
    ("json/", "JSON"),
    ("msgspec", "JSON"),
    ("pydantic", "JSON"),
    ("server/protocol.py", "JSON"),
    ("server/audio.py", "PCM decode + resample"),
    ("soxr", "PCM decode + resample"),
    ("speech_detector.py", "VAD"),
    ("onnxruntime", "VAD"),
    ("zmq/", "ZMQ"),
    ("core/client.py", "engine client: ring write, positions"),
    ("core/shared.py", "engine client: ring write, positions"),
    ("nemo_serve/engine/", "result assembly (detokenise)"),
    ("grpc/", "gRPC + protobuf"),
    ("protobuf", "gRPC + protobuf"),
    ("prometheus_client", "metrics"),
    ("server/metrics.py", "metrics"),
    ("nemo_serve/server/", "session + wire format"),
    ("asyncio/", "event loop (asyncio)"),
    ("uvloop", "event loop (asyncio)"),
    ("selectors", "event loop (asyncio)"),
)
PASS_THROUGH = ("numpy/", "<frozen", "typing.py", "enum.py", "abc.py", "functools.py", "contextlib.py",
                "dataclasses.py", "copy.py")  # fmt: skip


def _frames(stack: str) -> list[tuple[str, str]]:
    """'f (file:line);g (file:line)' -> [(function, file)], leaf first."""
    out = []
    for part in stack.split(";"):
        name, _, where = part.rpartition(" (")
        out.append((name or part, where.rsplit(":", 1)[0]))
    return out[::-1]


def _phase(frames: list[tuple[str, str]]) -> str:
    for func, file in frames:
        for (name, hint), phase in PHASES:
            if (func == name or func.endswith("." + name)) and hint in file:  # py-spy writes Class.method
                return phase
    return OTHER_PHASE


def _component(frames: list[tuple[str, str]]) -> str:
    for _, file in frames:
        if any(p in file for p in PASS_THROUGH):
            continue
        for hint, component in COMPONENTS:
            if hint in file:
                return component
        return "other: " + file.rsplit("/", 1)[-1]
    return "other"


def categorize(raw: str, top: int = 15) -> dict:
    """Shares of the samples by phase and by component, and the functions with most own samples."""
    phases: Counter = Counter()
    components: Counter = Counter()
    own: Counter = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n, frames = int(count), _frames(stack)
        total += n
        phases[_phase(frames)] += n
        components[_component(frames)] += n
        func, file = frames[0]
        own[f"{func} ({file.rsplit('/', 1)[-1]})"] += n
    share = lambda c: {k: round(v / max(total, 1), 4) for k, v in c.most_common()}  # noqa: E731
    return {"samples": total, "by_phase": share(phases), "by_component": share(components),
            "top_own": {k: round(v / max(total, 1), 4) for k, v in own.most_common(top)}}  # fmt: skip


def plot(result: dict, path) -> None:
    """µs per paced packet (all in) per path, one bar per source tree, the target as a line; one
    panel per number of front ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 4 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        paths = list(run["trees"][0]["paths"])
        width = 0.8 / len(run["trees"])
        for i, tree in enumerate(run["trees"]):
            ys = [tree["paths"][p]["us_per_packet_all_in"] for p in paths]
            ax.bar([j + i * width for j in range(len(paths))], ys, width, label=tree["tree"])
        ax.axhline(result["target_us_per_packet"], color="grey", ls=":", label="target")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(paths))], paths, rotation=20, fontsize=8)
        ax.set_ylabel("front-end CPU per paced packet (µs, results included)")
        ax.set_title(f"{run['frontends']} front end(s), {result['streams_per_frontend']} streams each")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

"""Prometheus metrics, one registry per app (so two apps in one process never collide).

Each metric moves at one lifecycle point: open/close of a stream (session), open/close of a
TCP connection and refusals over the connection caps (connections.py), refusal at the
handshake or at slot acquisition (app / session), every step (the engine's on_step hook, on
the loop thread: prometheus-client is thread-safe), every result sent (session).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# The *_created series double the output and nobody graphs them. (Process-wide switch.)
disable_created_metrics()

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
_STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def batch_size_label(n: int) -> str:
    """Power-of-two bins ("1", "2", "3-4", "5-8", ...): a label per exact size would make
    max_batch histograms of ~15 series each."""
    if n <= 2:
        return str(n)
    hi = 1 << (n - 1).bit_length()
    return f"{hi // 2 + 1}-{hi}"


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, num_slots: int, free_slots_fn) -> None:
        r = self.registry = CollectorRegistry()
        self.open_streams = Gauge("nemo_serve_open_streams", "WebSocket streams holding a slot", registry=r)
        self.free_slots = Gauge("nemo_serve_free_slots", "Slots not held by any stream", registry=r)
        self.free_slots.set_function(free_slots_fn)  # read from the engine: one owner of the count
        self.total_slots = Gauge("nemo_serve_slots", "Slots allocated at start-up", registry=r)
        self.total_slots.set(num_slots)
        self.draining = Gauge("nemo_serve_draining", "1 while the server drains after SIGTERM", registry=r)
        self.streams = Counter("nemo_serve_streams", "Streams admitted", registry=r)
        self.refusals = Counter("nemo_serve_refusals", "Connections refused, by reason", ["reason"], registry=r)
        self.stream_errors = Counter("nemo_serve_stream_errors", "Streams ended by an error, by reason", ["reason"], registry=r)
        refusal_reasons = ("no_free_slot", "draining", "unauthorized", "origin", "connection_limit", "header_timeout", "engine_failed")
        for reason in refusal_reasons:  # export zeros, so rate() works from the start
            self.refusals.labels(reason=reason)
        self.connections = Gauge("nemo_serve_connections", "Open TCP connections (HTTP and WebSocket)", registry=r)
        self.step_duration = Histogram(
            "nemo_serve_step_duration_seconds",
            "Duration of one batched model step (features, encoder, decoder), by batch size bin",
            ["batch_size"],
            buckets=_STEP_BUCKETS_S,
            registry=r,
        )
        self.batch_size = Histogram("nemo_serve_batch_size", "Streams per model step", buckets=_BATCH_BUCKETS, registry=r)
        self.audio_seconds = Counter("nemo_serve_audio_seconds", "Seconds of audio consumed by the model", registry=r)
        self.partial_latency = Histogram(
            "nemo_serve_partial_latency_seconds",
            "Partial result sent time minus arrival time of the audio that produced it",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.final_latency = Histogram(
            "nemo_serve_final_latency_seconds",
            "Final result sent time minus arrival time of the audio that produced it",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )

    def on_step(self, batch_size: int, seconds: float) -> None:
        """Engine hook, called on the loop thread after every step."""
        self.step_duration.labels(batch_size=batch_size_label(batch_size)).observe(seconds)
        self.batch_size.observe(batch_size)

    def render(self) -> bytes:
        return generate_latest(self.registry)

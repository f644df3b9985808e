"""Prometheus metrics, one registry per app (so two apps in one process never collide).

Each metric moves at one lifecycle point: open/close of a stream (session), open/close of a
TCP connection and refusals over the connection caps (connections.py), refusal at the
handshake or at slot acquisition (app / session), every step (StepMetrics, in the engine-core
process; a front end's /metrics reads them from PROMETHEUS_MULTIPROC_DIR), every result sent
(session).
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
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


def multiprocess_dir() -> str | None:
    """Set (by the supervisor) when the server runs as several processes: every process writes
    its metrics there and any front end's /metrics adds them up (prometheus-client's
    multiprocess mode). Read once at import by prometheus-client itself."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class StepMetrics:
    """Per-step metrics, observed where the step loop runs (the engine core), by chunk mode
    (`context_right`): a step runs the streams of one mode."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.step_duration = Histogram(
            "nemo_serve_step_duration_seconds",
            "Duration of one batched model step (features, encoder, decoder), by batch size bin and chunk mode",
            ["batch_size", "context_right"],
            buckets=_STEP_BUCKETS_S,
            registry=r,
        )
        self.batch_size = Histogram("nemo_serve_batch_size", "Streams per model step, by chunk mode", ["context_right"],
                                    buckets=_BATCH_BUCKETS, registry=r)  # fmt: skip

    def on_step(self, batch_size: int, seconds: float, context_right: int | None = None) -> None:
        """Engine hook, called on the loop thread after every step."""
        mode = str(context_right)
        self.step_duration.labels(batch_size=batch_size_label(batch_size), context_right=mode).observe(seconds)
        self.batch_size.labels(context_right=mode).observe(batch_size)


class _SlotGauges:
    """free and total slots and the queue delay, read at scrape time (multiprocess mode has no
    set_function); with several engine cores (--devices), also each core's."""

    def __init__(self, num_slots: int, free_slots_fn, cores_fn=None, queue_delay_fn=None) -> None:
        self.num_slots, self.free_slots_fn, self.cores_fn = num_slots, free_slots_fn, cores_fn
        self.queue_delay_fn = queue_delay_fn

    def collect(self):
        yield GaugeMetricFamily("nemo_serve_free_slots", "Slots not held by any stream", value=self.free_slots_fn())
        yield GaugeMetricFamily("nemo_serve_slots", "Slots allocated at start-up", value=self.num_slots)
        if self.queue_delay_fn is not None:
            yield GaugeMetricFamily("nemo_serve_queue_delay_seconds",
                                    "How far behind real time the model's steps started, the most in the last 2 s (overload when it grows)",
                                    value=self.queue_delay_fn())  # fmt: skip
        if self.cores_fn is None:
            return
        cores = self.cores_fn()
        labels = ["core", "device"]
        for name, key, doc in (("nemo_serve_core_free_slots", "free_slots", "Free slots of one engine core"),
                               ("nemo_serve_core_open_streams", "open_streams", "Streams on one engine core"),
                               ("nemo_serve_core_serving", "serving", "1 while the engine core serves"),
                               ("nemo_serve_core_queue_delay_seconds", "queue_delay_s",
                                "How far behind real time one engine core's steps started, the most in the last 2 s")):  # fmt: skip
            g = GaugeMetricFamily(name, doc, labels=labels)
            for c in cores:
                g.add_metric([str(c["core"]), c["device"]], float(c[key]))
            yield g


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, num_slots: int, free_slots_fn, cores_fn=None, queue_delay_fn=None) -> None:
        """`cores_fn`: each engine core's numbers (EngineGroup.cores), for per-core gauges.
        `queue_delay_fn`: the engine's queue delay in seconds (engine/queue_delay.py)."""
        self.multiprocess = multiprocess_dir() is not None
        r = self.registry = CollectorRegistry()
        self._slots = _SlotGauges(num_slots, free_slots_fn, cores_fn, queue_delay_fn)
        if not self.multiprocess:
            r.register(self._slots)
        self.open_streams = Gauge("nemo_serve_open_streams", "WebSocket streams holding a slot", registry=r,
                                  multiprocess_mode="livesum")  # fmt: skip
        self.draining = Gauge("nemo_serve_draining", "1 while the server drains after SIGTERM", registry=r,
                              multiprocess_mode="livemax")  # fmt: skip
        self.streams = Counter("nemo_serve_streams", "Streams admitted", registry=r)
        self.mode_open_streams = Gauge("nemo_serve_mode_open_streams", "Streams holding a slot, by chunk mode",
                                       ["context_right"], registry=r, multiprocess_mode="livesum")  # fmt: skip
        self.mode_streams = Counter("nemo_serve_mode_streams", "Streams admitted, by chunk mode", ["context_right"], registry=r)
        self.refusals = Counter("nemo_serve_refusals", "Connections refused, by reason", ["reason"], registry=r)
        self.stream_errors = Counter("nemo_serve_stream_errors", "Streams ended by an error, by reason", ["reason"], registry=r)
        self.file_transcriptions = Counter("nemo_serve_file_transcriptions", "File transcriptions (POST /v1/audio/transcriptions and /v1/listen), by HTTP status",
                                           ["status"], registry=r)  # fmt: skip
        refusal_reasons = ("no_free_slot", "draining", "unauthorized", "origin", "connection_limit", "header_timeout", "engine_failed",
                           "overloaded", "bad_request")
        for reason in refusal_reasons:  # export zeros, so rate() works from the start
            self.refusals.labels(reason=reason)
        self.connections = Gauge("nemo_serve_connections", "Open TCP connections (HTTP and WebSocket)", registry=r,
                                 multiprocess_mode="livesum")  # fmt: skip
        self.audio_seconds = Counter("nemo_serve_audio_seconds", "Seconds of audio consumed by the model", registry=r)
        self.partial_latency = Histogram(
            "nemo_serve_partial_latency_seconds",
            "Partial result sent time minus arrival time of the audio that produced it, by chunk mode",
            ["context_right"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.final_latency = Histogram(
            "nemo_serve_final_latency_seconds",
            "Final result sent time minus arrival time of the audio that produced it, by chunk mode",
            ["context_right"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )

    def stream_opened(self, mode: str) -> None:
        self.open_streams.inc()
        self.streams.inc()
        self.mode_open_streams.labels(context_right=mode).inc()
        self.mode_streams.labels(context_right=mode).inc()

    def stream_closed(self, mode: str) -> None:
        self.open_streams.dec()
        self.mode_open_streams.labels(context_right=mode).dec()

    def result_sent(self, is_final: bool, mode: str, latency_s: float) -> None:
        (self.final_latency if is_final else self.partial_latency).labels(context_right=mode).observe(latency_s)

    def render(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # every process's files, summed
        registry.register(self._slots)
        return generate_latest(registry)

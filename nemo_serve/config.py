"""One validated settings object for the server, from command-line flags and the environment.

Precedence: a flag given on the command line, else the environment variable
NEMO_SERVE_<FIELD NAME IN CAPITALS> (NEMO_SERVE_AUTH_TOKEN, NEMO_SERVE_NUM_SLOTS, ...), else
the default here. The token is best passed through the environment: flags show in `ps`.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .engine.endpoint import EndpointConfig

ENV_PREFIX = "NEMO_SERVE_"

PositiveSeconds = Annotated[float, Field(gt=0, le=7 * 24 * 3600)]


class SettingsError(ValueError):
    """A flag or environment value is invalid; the message is one line."""


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    # model and engine
    model: str | None = None  # .nemo path, builtin:NAME or pretrained name; None: the shipped demo model
    # One mode ("3"), several ("0,3,13": the first is the default) or "all" trained modes; None: the
    # model's first trained mode. Kept as text; engine.geometry.parse_modes checks it here and load_model reads it.
    context_right: str | None = None
    dtype: Literal["fp32", "bf16"] = "fp32"
    device: Annotated[str, Field(pattern=r"^(cpu|cuda(:\d+)?)$")] = "cpu"
    # One engine core per device behind the same front ends (core/supervisor.py): "cuda:0,cuda:1",
    # "all" (every CUDA device), or "cpu,cpu" (two cores on the CPU, for tests). None: one core on --device.
    devices: Annotated[str, Field(pattern=r"^(all|(cpu|cuda(:\d+)?)(,(cpu|cuda(:\d+)?))*)$")] | None = None
    num_slots: Annotated[int, Field(ge=1, le=65536)] = 16
    max_batch: Annotated[int, Field(ge=1, le=65536)] | None = None  # None: num_slots
    kv_cache: bool = True  # cache projected keys/values (engine/encoder.py); False: NeMo's layer code
    # Front-end processes around the engine-core process(es) (nemo_serve/core); None:
    # core/supervisor.default_frontends() from the CPU count.
    frontends: Annotated[int, Field(ge=1, le=64)] | None = None
    audio_ring_s: Annotated[float, Field(ge=0.25, le=60)] = 2.0  # shared-memory audio per slot
    # A confidence per word in finals, from the decoder's own scores (engine/step.py); off by
    # default: it adds a softmax per emitted label to every step (benchmarks/confidence_bench.py).
    word_confidence: bool = False
    # A streaming Sortformer beside the ASR model (diarization/load.py): builtin:NAME or a .nemo;
    # None: streams that ask for speakers are refused.
    diarizer: Annotated[str, Field(min_length=1)] | None = None
    # network
    host: str = "127.0.0.1"  # loopback by default: exposing the port is a deliberate --host 0.0.0.0
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    # Riva ASR gRPC (server/riva_grpc.py) on its own port, same host, TLS and token; None: off
    grpc_port: Annotated[int, Field(ge=0, le=65535)] | None = None
    # the streaming routes again on picows (server/picows_listener.py), same host and TLS; None: off
    fast_ws_port: Annotated[int, Field(ge=0, le=65535)] | None = None
    # the Riva gRPC service again on our own HTTP/2 (server/fast_grpc.py), same host, TLS, token; None: off
    fast_grpc_port: Annotated[int, Field(ge=0, le=65535)] | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    auth_token: Annotated[str, Field(min_length=1)] | None = None
    # Browser pages allowed to open streams, besides the server's own (comma-separated origins,
    # "*" for any); clients that send no Origin (not browsers) are always allowed.
    allowed_origins: str | None = None
    # limits
    max_connections: Annotated[int, Field(ge=1, le=1_000_000)] = 1024  # open sockets, HTTP and WebSocket
    max_connections_per_ip: Annotated[int, Field(ge=1, le=1_000_000)] = 256
    header_timeout_s: PositiveSeconds = 10.0  # from connect (or a keep-alive request's first byte) to a whole request
    send_timeout_s: PositiveSeconds = 10.0  # a result the client's socket does not take in this time: closed
    max_message_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] = 1 << 20  # sherpa-onnx's default
    max_file_bytes: Annotated[int, Field(ge=1024, le=1 << 34)] = 25 << 20  # POST /v1/audio/transcriptions and /v1/listen; OpenAI's limit
    idle_timeout_s: PositiveSeconds = 30.0  # no message from the client while input is open
    ping_interval_s: Annotated[float, Field(ge=0, le=3600)] = 20.0  # 0: no keepalive pings
    ping_timeout_s: PositiveSeconds = 20.0
    max_stream_s: PositiveSeconds = 3600.0  # wall time and audio time of one stream
    drain_timeout_s: PositiveSeconds = 30.0  # SIGTERM: how long open streams get to finish
    # Overload: new streams are refused while the model's steps start this far behind real time
    # (engine/queue_delay.py), so the streams already served do not fall further behind. 0: off.
    max_queue_delay_s: Annotated[float, Field(ge=0, le=3600)] = 2.0
    # Phrase boosting (engine/phrases.py): a stream's `phrases` in its config message. Per stream
    # (0: boosting off), characters per phrase, and phrases of all open streams together (each
    # distinct list is a boosting tree in the decoder; every boosted step walks them).
    max_phrases_per_stream: Annotated[int, Field(ge=0, le=10000)] = 100
    max_phrase_chars: Annotated[int, Field(ge=1, le=1000)] = 64
    max_phrases_total: Annotated[int, Field(ge=0, le=10_000_000)] = 10000
    # endpointing defaults (each stream may override them in its config message)
    endpoint: bool = True
    rule1_min_trailing_silence: PositiveSeconds = 2.4
    rule2_min_trailing_silence: PositiveSeconds = 1.2
    rule3_min_utterance_length: PositiveSeconds = 20.0
    # Encoding of a stream that names none (no config message, no ?encoding=). float32 is what
    # sherpa-onnx's clients send, unannounced; PCM16 clients without a config say so in the URL.
    default_encoding: Literal["pcm_f32le", "pcm_s16le"] = "pcm_f32le"
    # A front end hands the heap glibc keeps free back to the OS (malloc_trim) this often, at a quiet
    # moment of its loop (server/heap_trim.py): one call cost 0.02-0.06 ms on an intact 100 MiB heap,
    # 15-16 ms on one with 72 MiB to give back, 4-8 ms again after that (heap_trim_cost_cpu.json); a
    # front end keeps about 7 MiB free (soak_trim_cpu.json). 0: off; a no-op without glibc.
    heap_trim_period_s: Annotated[float, Field(ge=0, le=24 * 3600)] = 60.0
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    @field_validator("context_right", mode="before")
    @classmethod
    def _modes(cls, v):
        if v is None:
            return None
        from .engine.geometry import parse_modes

        modes = parse_modes(v if isinstance(v, (int, list, tuple)) else str(v))
        return "all" if modes == "all" else ",".join(map(str, modes))

    @field_validator("frontends", mode="before")
    @classmethod
    def _frontends(cls, v):
        # Before the range check, so that 0 (a user asking for one process) hears what to run instead.
        if v is not None and str(v).strip() == "0":
            raise ValueError("0 is not a serving mode: the engine always runs in an engine-core process "
                             "behind front ends; use --frontends 1 for the fewest processes")
        return v

    @field_validator("ssl_certfile", "ssl_keyfile")
    @classmethod
    def _tls_file(cls, p: Path | None) -> Path | None:
        if p is not None and not p.is_file():
            raise ValueError(f"TLS file not found: {p}")
        return p

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, v: str | None) -> str | None:
        for origin in _split_origins(v):
            parts = urlsplit(origin)
            if origin not in ("*", "null") and (parts.scheme not in ("http", "https") or not parts.netloc or parts.path):
                raise ValueError(f"{origin!r} is not an origin (scheme://host[:port], '*' or 'null')")
        return v

    @model_validator(mode="after")
    def _check(self) -> "Settings":
        # Errors here name their flags themselves: a model-level error has no field to name.
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("--ssl-keyfile needs --ssl-certfile")
        if self.ssl_certfile is not None:
            check_tls_files(self.ssl_certfile, self.ssl_keyfile)
        if self.grpc_port is not None and self.grpc_port == self.port and self.port != 0:
            # both are SO_REUSEPORT sockets: the kernel would hand HTTP clients to gRPC and back
            raise ValueError(f"--grpc-port {self.grpc_port} is --port's too; give it a port of its own")
        if self.fast_ws_port is not None and self.fast_ws_port in (self.port, self.grpc_port) and self.fast_ws_port:
            raise ValueError(f"--fast-ws-port {self.fast_ws_port} is taken by --port or --grpc-port")
        if self.fast_grpc_port and self.fast_grpc_port in (self.port, self.grpc_port, self.fast_ws_port):
            raise ValueError(f"--fast-grpc-port {self.fast_grpc_port} is taken by --port, --grpc-port or --fast-ws-port")
        return self

    def device_list(self) -> list[str]:
        """The engine cores' devices: --devices (all: every CUDA device) or the one --device."""
        if self.devices is None:
            return [self.device]
        if self.devices == "all":
            import torch  # only here: the supervisor otherwise imports no torch

            n = torch.cuda.device_count()
            if n == 0:
                raise ValueError("--devices all: no CUDA device is visible")
            return [f"cuda:{i}" for i in range(n)]
        return self.devices.split(",")

    @property
    def origin_allow_list(self) -> frozenset[str]:
        return frozenset(_split_origins(self.allowed_origins))

    @property
    def endpoint_config(self) -> EndpointConfig:
        return EndpointConfig(
            enabled=self.endpoint,
            rule1_min_trailing_silence_s=self.rule1_min_trailing_silence,
            rule2_min_trailing_silence_s=self.rule2_min_trailing_silence,
            rule3_min_utterance_length_s=self.rule3_min_utterance_length,
        ).validated()

    @property
    def phrase_limits(self):
        from .engine.phrases import PhraseLimits

        return PhraseLimits(self.max_phrases_per_stream, self.max_phrase_chars, self.max_phrases_total)

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    @classmethod
    def from_sources(cls, flags: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> "Settings":
        """Flags (None = not given) over NEMO_SERVE_* environment variables over defaults."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            if flags.get(name) is not None:
                values[name] = flags[name]
            elif ENV_PREFIX + name.upper() in environ:
                raw = environ[ENV_PREFIX + name.upper()]
                values[name] = _env_bool(raw) if cls.model_fields[name].annotation is bool else raw
        try:
            return cls(**values)
        except ValidationError as e:
            first = e.errors()[0]
            msg = first["msg"].removeprefix("Value error, ")
            if not first["loc"]:  # from _check, which names its flags
                raise SettingsError(msg) from None
            name = ".".join(str(p) for p in first["loc"])
            flag = "--" + name.replace("_", "-")
            raise SettingsError(f"{flag} (or {ENV_PREFIX}{name.upper()}): {msg}") from None


def _split_origins(v: str | None) -> list[str]:
    return [o.strip().lower().rstrip("/") for o in (v or "").split(",") if o.strip()]


def check_tls_files(certfile: Path, keyfile: Path | None) -> None:
    """Load the certificate and key as the server will, so that a bad file is one line at
    start-up (naming its flag), not a traceback from inside uvicorn. Encrypted keys are refused:
    OpenSSL would prompt for the passphrase on the terminal."""

    def no_passphrase() -> str:
        raise ValueError("encrypted")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile, password=no_passphrase)
    except (ssl.SSLError, OSError, ValueError) as e:
        if b"-----BEGIN CERTIFICATE-----" not in certfile.read_bytes():
            raise ValueError(f"--ssl-certfile: {certfile} is not a PEM certificate ({e})") from None
        where = f"--ssl-keyfile: {keyfile}" if keyfile else f"--ssl-certfile: {certfile} (no --ssl-keyfile)"
        raise ValueError(
            f"{where}: no PEM private key that matches the certificate, or the key is encrypted ({e})"
        ) from None


def _env_bool(raw: str) -> Any:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    return raw  # pydantic refuses it with a message

"""NVIDIA's published Riva ASR protos, from the `nvidia-riva-client` package, behind one import.

The generated modules (`riva.client.proto.riva_asr_pb2`, `_grpc`, `riva_audio_pb2`) are the wire
format Riva's clients speak; using NVIDIA's own, not a copy compiled here, keeps the field numbers
theirs. The package's metadata pins protobuf==6.33.5 and websockets<16, which the server's lock
outgrows, so it is installed with --no-deps (env/setup.sh): its generated code accepts any newer
protobuf runtime, and the one module that needs websockets (riva.client.realtime) is not imported.
"""

from __future__ import annotations

TESTED_VERSION = "2.27.0"


class RivaProtosMissing(RuntimeError):
    """--grpc-port without the protos; the message says how to install them."""


def load():
    """(riva_asr_pb2, riva_asr_pb2_grpc, riva_audio_pb2); RivaProtosMissing if not installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("nvidia-riva-client")
        except PackageNotFoundError:
            found = None
        from riva.client.proto import riva_asr_pb2, riva_asr_pb2_grpc, riva_audio_pb2
    except ImportError as e:
        raise RivaProtosMissing(
            f"--grpc-port needs NVIDIA's Riva protos: pip install --no-deps nvidia-riva-client=={TESTED_VERSION} ({e})"
        ) from None
    if found is not None and found.split(".")[0] != TESTED_VERSION.split(".")[0]:
        raise RivaProtosMissing(f"nvidia-riva-client {found} found; --grpc-port is tested with {TESTED_VERSION}")
    return riva_asr_pb2, riva_asr_pb2_grpc, riva_audio_pb2

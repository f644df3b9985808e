"""NVIDIA's published Riva ASR protos, from the `nvidia-riva-client` package, behind one import.

The generated modules (`riva.client.proto.riva_asr_pb2`, `_grpc`, `riva_audio_pb2`) are the wire
format Riva's clients speak; using NVIDIA's own, not a copy compiled here, keeps the field numbers
theirs. The package's metadata pins protobuf==6.33.5 and websockets<16, which the server's lock
outgrows, so it is installed with --no-deps (env/setup.sh): its generated code accepts any newer
protobuf runtime, and the one module that needs websockets (riva.client.realtime) is not imported.

`add_servicer` registers the service as the generated code does, but parses requests itself, so
bytes that are not a request are the client's INVALID_ARGUMENT, not grpc's UNKNOWN (Malformed).
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


class Malformed:
    """A request whose bytes are not the RPC's message. The generated registration parses with
    `FromString`, whose DecodeError grpc answers UNKNOWN with the parser's class name before any
    handler runs; parsing here instead hands the handler this marker, refused INVALID_ARGUMENT
    in the client's terms (issue 45)."""

    def __init__(self, message_name: str) -> None:
        self.reason = f"the request is not a valid {message_name}: its protobuf bytes could not be parsed"


def request_parser(message_class):
    """bytes -> a `message_class` request, or Malformed (fast_grpc.py parses with it too)."""
    name = message_class.DESCRIPTOR.name

    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except Exception:  # noqa: BLE001 - DecodeError, or the parser's depth limit: the bytes are the client's
            return Malformed(name)

    return parse


def add_servicer(server, servicer, pb) -> None:
    """riva_asr_pb2_grpc.add_RivaSpeechRecognitionServicer_to_server, parsing with _parser (see
    Malformed). `servicer`: riva_grpc.RivaSpeechRecognition; `pb`: riva_asr_pb2."""
    import grpc  # here, not at the top: cli.py imports this module to check the protos, grpcio or not

    unary, stream = grpc.unary_unary_rpc_method_handler, grpc.stream_stream_rpc_method_handler
    handlers = {
        "Recognize": unary(servicer.Recognize, request_parser(pb.RecognizeRequest), pb.RecognizeResponse.SerializeToString),
        "StreamingRecognize": stream(servicer.StreamingRecognize, request_parser(pb.StreamingRecognizeRequest),
                                     pb.StreamingRecognizeResponse.SerializeToString),  # fmt: skip
        "GetRivaSpeechRecognitionConfig": unary(servicer.GetRivaSpeechRecognitionConfig,
                                                request_parser(pb.RivaSpeechRecognitionConfigRequest),
                                                pb.RivaSpeechRecognitionConfigResponse.SerializeToString),  # fmt: skip
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(pb.DESCRIPTOR.services_by_name[
        "RivaSpeechRecognition"].full_name, handlers),))  # fmt: skip

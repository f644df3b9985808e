"""NVIDIA's realtime ASR client for a file, as `scripts/asr/realtime_asr_client.py` of
nvidia-riva/python-clients (github.com/nvidia-riva/python-clients, MIT) drives it with
`--input-file F --output-text T`; that script is not in the nvidia-riva-client wheel, so this is
its file path step for step (our own text, not a copy): the same argument parser (riva.client's
argparse helpers, the script's own options and defaults), `create_audio_iterator`'s file branch,
`run_transcription` (connect, send and receive side by side, save_responses, disconnect) and
`main`'s "Fatal error" exit. Everything it prints, logs and saves comes from the installed
`riva.client.realtime.RealtimeClientASR`. tests/test_nim_sessions.py runs the script itself instead
when NEMO_SERVE_RIVA_REALTIME_SCRIPT names an unchanged copy.
"""

import argparse
import asyncio
import sys

from riva.client.argparse_utils import (
    add_asr_config_argparse_parameters,
    add_connection_argparse_parameters,
    add_realtime_config_argparse_parameters,
)
from riva.client.asr import AudioChunkFileIterator, get_wav_file_parameters
from riva.client.realtime import RealtimeClientASR


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--input-file", required=True)
    parser.add_argument("--mic", action="store_true")  # the script's other input mode; off here
    parser.add_argument("--sample-rate-hz", type=int, default=16000)
    parser.add_argument("--num-channels", type=int, default=1)
    parser.add_argument("--file-streaming-chunk", type=int, default=1600)
    parser.add_argument("--output-text", type=str)
    parser.add_argument("--prompt", default="")
    parser = add_connection_argparse_parameters(parser)
    parser.set_defaults(server="localhost:9000")
    parser = add_asr_config_argparse_parameters(parser, max_alternatives=True, profanity_filter=True, word_time_offsets=True)
    return add_realtime_config_argparse_parameters(parser).parse_args()


async def run_transcription(args: argparse.Namespace) -> None:
    client = RealtimeClientASR(args=args)
    try:
        wav_parameters = get_wav_file_parameters(args.input_file)
        if wav_parameters is not None:
            args.sample_rate_hz = wav_parameters["framerate"]
            args.num_channels = wav_parameters["nchannels"]
        chunks = AudioChunkFileIterator(args.input_file, args.file_streaming_chunk, delay_callback=None)
        await client.connect()
        await asyncio.gather(client.send_audio_chunks(chunks), client.receive_responses())
        if args.output_text:
            client.save_responses(args.output_text)
    finally:
        await client.disconnect()


if __name__ == "__main__":
    try:
        asyncio.run(run_transcription(parse_args()))
    except Exception as e:
        print(f"Fatal error: {e}")
        sys.exit(1)

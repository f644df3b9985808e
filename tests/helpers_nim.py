"""NVIDIA's NIM realtime client run against the real server: its parsed arguments, one run in
process, and many runs of its script as subprocesses (test_nim_sessions.py, test_eou_server.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from .helpers_server import TOKEN


def riva_args(server, **overrides) -> argparse.Namespace:
    """What scripts/asr/realtime_asr_client.py's parser gives for `--input-file F --server HOST:PORT
    --mint-api-key TOKEN --word-time-offsets` (its defaults, from riva.client.argparse_utils)."""
    args = dict(
        server=f"127.0.0.1:{server.port}", endpoint="/v1/realtime", query_params="intent=transcription",
        use_ssl=False, ssl_root_cert=None, ssl_client_cert=None, ssl_client_key=None, mint_api_key=TOKEN,
        mic=False, language_code="en-US", model_name="", prompt="", sample_rate_hz=16000, num_channels=1,
        max_alternatives=1, automatic_punctuation=False, word_time_offsets=True, profanity_filter=False,
        no_verbatim_transcripts=False, speaker_diarization=False, diarization_max_speakers=3, boosted_lm_words=None,
        boosted_lm_score=4.0, start_history=-1, start_threshold=-1.0, stop_history=-1, stop_threshold=-1.0,
        stop_history_eou=-1, stop_threshold_eou=-1.0, custom_configuration="", file_streaming_chunk=1600,
    )  # fmt: skip
    return argparse.Namespace(**{**args, **overrides})


async def run_riva_client(args: argparse.Namespace, path: Path, force_eou_at: int | None = None
                          ) -> tuple[list[dict], "RealtimeClientASR"]:  # fmt: skip
    """The script's run_transcription for a file: connect, then send and receive side by side.
    The socket's recv is tapped once connected (every event the client reads after its session
    update is kept); nothing else is changed. `force_eou_at`: the client's force_eou on that
    packet (its API's `force_eou_chunks`)."""
    from riva.client.asr import AudioChunkFileIterator, get_wav_file_parameters
    from riva.client.realtime import RealtimeClientASR

    args.sample_rate_hz = get_wav_file_parameters(path)["framerate"]
    client = RealtimeClientASR(args=args)
    await client.connect()
    events: list[dict] = []
    recv = client.websocket.recv

    async def tapped(*a, **kw):
        message = await recv(*a, **kw)
        events.append(json.loads(message))
        return message

    client.websocket.recv = tapped
    forced = None if force_eou_at is None else (i == force_eou_at for i in range(10**6))
    try:
        await asyncio.wait_for(asyncio.gather(
            client.send_audio_chunks(AudioChunkFileIterator(str(path), args.file_streaming_chunk), forced),
            client.receive_responses(),
        ), 60)  # fmt: skip
    finally:
        await client.disconnect()
    return events, client


async def nvidia_client_runs(server, paths: list[Path], out: Path, concurrency: int) -> dict[str, tuple[int, str, str | None]]:
    """NVIDIA's client script on each file, `concurrency` at a time, as its user runs it:
    name -> (exit status, what it printed and logged, the text it saved or None)."""
    script = os.environ.get("NEMO_SERVE_RIVA_REALTIME_SCRIPT") or str(NIM_CLIENT)
    gate = asyncio.Semaphore(concurrency)

    async def one(path: Path) -> tuple[str, tuple[int, str, str | None]]:
        saved = out / f"{path.stem}.txt"
        async with gate:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, script, "--input-file", str(path), "--server", f"127.0.0.1:{server.port}",
                "--mint-api-key", TOKEN, "--output-text", str(saved),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
            shown, _ = await asyncio.wait_for(proc.communicate(), 120)
        return path.name, (proc.returncode, shown.decode(errors="replace"), saved.read_text() if saved.exists() else None)

    return dict(await asyncio.gather(*(one(p) for p in paths)))


NIM_CLIENT = Path(__file__).parent / "nim_client" / "realtime_asr_file_client.py"

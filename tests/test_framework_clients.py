"""Voice-agent frameworks' OpenAI Realtime STT services against the real server (demo model).

Two kinds of test, each checking every committed item's tokens against /ws on that item's audio
(PCM16 at 24 kHz, endpointing off: /ws's tokens for exactly the audio the item holds):

- live: the framework's own STT service, unchanged but for its URL (tests/framework_clients/
  drives it, its own local VAD putting the commits), through a recording relay (wire_recorder.py);
  each item's audio is taken from the wire, as pipecat resamples its 16 kHz pipeline's audio and
  its VAD decides where items end (livekit as four sessions at once, six turns each: a quarter of
  the time of one session at its 4x real time). Needs the framework: here, or in the
  interpreter NEMO_SERVE_FRAMEWORK_PYTHON names (pipecat-ai 1.14's pins clash with this project's
  lock, so it lives in a venv of its own); skipped, saying so, without it. With
  NEMO_SERVE_RECORD_WIRE=1 it rewrites the recording below.
- replay: tests/framework_wire/*.json, what the live run recorded the framework send (per session
  its session.update as sent, the size of every append, each commit, in order; audio as sample
  counts), sent again over real WebSockets with the same audio. Needs only this project.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile
import websockets

import nemo_serve
from nemo_serve.client import StreamingClient
from nemo_serve.model import DEMO_MODEL_PATH

from .helpers_server import TOKEN, start_server
from .wire_recorder import WireRecorder

RATE = 24000
HERE = Path(__file__).parent
DRIVERS = HERE / "framework_clients"
RECORDINGS = HERE / "framework_wire"
UTTERANCES = sorted((Path(nemo_serve.__file__).parent / "assets" / "demo" / "utterances").glob("*.wav"))
COMPLETED = "conversation.item.input_audio_transcription.completed"

# name -> (module to import, driver and its arguments before the turns, the rate of the turns the
# driver reads, silence after each turn (the drivers add it), sessions at once (runs of consecutive
# turns, each a stream of its own: livekit's four take a quarter of one stream's time, 4x real time)
FRAMEWORKS = {
    "pipecat": ("pipecat", ["pipecat_realtime_stt.py", "{ws}/v1/realtime", TOKEN], 16000, 1.0, 1),
    "livekit": ("livekit.plugins.openai", ["livekit_realtime_stt.py", "{http}/v1", TOKEN, "gpt-realtime-whisper",
                                           "--sessions", "4"], RATE, 1.0, 4),
}
CLIENT_LABELS = {
    "pipecat": "pipecat-ai 1.14.0, OpenAIRealtimeSTTService(api_key, base_url) in its default mode: local VAD "
    "(VADProcessor(SileroVADAnalyzer()) in a 16 kHz pipeline), input_audio_buffer.commit on "
    "VADUserStoppedSpeakingFrame, pipecat's 16 -> 24 kHz stream resampler",
    "livekit": "livekit-agents / livekit-plugins-openai 1.8.9, openai.STT(model='gpt-realtime-whisper', "
    "use_realtime=True, base_url, api_key): its bundled Silero VAD, a commit at each end of speech",
}


@pytest.fixture(scope="module")
def demo_server():
    with start_server("--context-right", "all", "--idle-timeout-s", "10", model=str(DEMO_MODEL_PATH)) as s:
        yield s
        s.assert_no_leak()


def turns_pcm(names: list[str], rate: int = RATE) -> list[np.ndarray]:
    """Bundled utterances as PCM16 at `rate` (24 kHz: what OpenAI's clients send)."""
    import soxr

    out = []
    for name in names:
        audio, file_rate = soundfile.read(UTTERANCES[0].parent / name, dtype="float32")
        if file_rate != rate:
            audio = soxr.resample(audio, file_rate, rate, quality="HQ")
        out.append(np.clip(np.round(audio * 32768.0), -32768, 32767).astype("<i2"))
    return out


def session_audio(turns: list[np.ndarray], silence_s: float) -> np.ndarray:
    gap = np.zeros(round(silence_s * RATE), dtype="<i2")
    return np.concatenate([np.concatenate([t, gap]) for t in turns])


def framework_python(module: str) -> str:
    """An interpreter that has `module`: this one, else NEMO_SERVE_FRAMEWORK_PYTHON's; or skip. Found,
    not imported (livekit's import took 4 s of CI, and the driver imports it anyway): one installed
    but broken fails the test instead of skipping it."""
    candidates = [sys.executable] + ([os.environ["NEMO_SERVE_FRAMEWORK_PYTHON"]]
                                     if os.environ.get("NEMO_SERVE_FRAMEWORK_PYTHON") else [])  # fmt: skip
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    for python in candidates:
        if subprocess.run([python, "-c", probe], capture_output=True).returncode == 0:  # a missing parent raises: 1
            return python
    pytest.skip(f"{module} is not installed here, nor in NEMO_SERVE_FRAMEWORK_PYTHON "
                "(an interpreter that has it; docs/protocol.md, 'Voice-agent frameworks')")  # fmt: skip


# ----------------------------------------------------------------------------- the wire, as recorded


def wire_script(client_events: list[dict]) -> list[dict]:
    """Client events with each append's audio replaced by its sample count."""
    script = []
    for e in client_events:
        e = {k: v for k, v in e.items() if k not in ("_t", "_c")}
        if e["type"] == "input_audio_buffer.append":
            script.append({"type": e["type"], "samples": len(base64.b64decode(e["audio"])) // 2})
        else:
            script.append(e)
    return script


def committed_items(script: list[dict], audio: np.ndarray) -> list[np.ndarray]:
    """The audio of each committed item: what was appended between one commit and the next."""
    items, start, pos = [], 0, 0
    for e in script:
        if e["type"] == "input_audio_buffer.append":
            pos += e["samples"]
        elif e["type"] == "input_audio_buffer.commit":
            items.append(audio[start:pos])
            start = pos
    assert pos <= len(audio), "the script appends more audio than the session has"
    return items


async def ws_tokens(server, pcm: np.ndarray) -> tuple[list[int], str]:
    """/ws on exactly this audio (24 kHz PCM16, 100 ms packets), endpointing off: one utterance."""
    async with StreamingClient(server.ws_url, sample_rate=RATE, encoding="pcm_s16le", token=TOKEN,
                               endpointing={"enabled": False}) as c:  # fmt: skip
        for i in range(0, len(pcm), RATE // 10):
            await c.send_audio(pcm[i : i + RATE // 10])
        await c.end()
        finals = [m async for m in c.messages() if m["type"] == "final"]
    return [t for f in finals for t in f["token_ids"]], " ".join(f["text"] for f in finals if f["text"])


def wire_items(client_events: list[dict]) -> list[np.ndarray]:
    """Each committed item's audio as the server received it: the decoded appends between one commit
    and the next (a framework that resamples sends other bytes than the test's own)."""
    items, pending = [], []
    for e in client_events:
        if e["type"] == "input_audio_buffer.append":
            pending.append(np.frombuffer(base64.b64decode(e["audio"]), dtype="<i2"))
        elif e["type"] == "input_audio_buffer.commit":
            items.append(np.concatenate(pending) if pending else np.zeros(0, dtype="<i2"))
            pending = []
    return items


def check_completed_match_ws(server, items: list[np.ndarray],
                             server_events: list[dict]) -> tuple[list[str], list[tuple[list[int], str]]]:  # fmt: skip
    """Each committed item's completed (tokens, transcript) is /ws's on that item's audio; returns the
    item ids in commit order and /ws's (tokens, transcript) per item."""
    errors = [e for e in server_events if e["type"] == "error"]
    assert not errors, errors
    # items committed back to back decode side by side and may complete in any order (as OpenAI
    # documents): `committed` gives the item ids in commit order
    committed = [e["item_id"] for e in server_events if e["type"] == "input_audio_buffer.committed"]
    by_id = {e["item_id"]: e for e in server_events if e["type"] == COMPLETED}
    assert len(committed) == len(items) and sorted(by_id) == sorted(committed), "one completed item per commit"
    completed = [by_id[i] for i in committed]
    references = [asyncio.run(ws_tokens(server, item)) for item in items]
    got = [(e["nemo_serve"]["token_ids"], e["transcript"]) for e in completed]
    assert got == references
    assert all(tokens for tokens, _ in references), "an item gave no tokens: the comparison would be weak"
    return committed, references


def check_items_match_ws(server, script: list[dict], audio: np.ndarray, server_events: list[dict],
                         turns: int) -> list[tuple[list[int], str]]:  # fmt: skip
    """check_completed_match_ws on the items the script cuts from `audio`, one per turn."""
    items = committed_items(script, audio)
    assert len(items) == turns, f"{len(items)} commits for {turns} turns"
    return check_completed_match_ws(server, items, server_events)[1]


def shown_texts(stdout: str, committed: list[str], session: int = 0) -> list[str]:
    """The driver's printed texts of one session in commit order: by the item id it printed beside
    each (pipecat passes items on as they complete), else as printed."""
    shown = [s for s in map(json.loads, stdout.splitlines()) if s.get("session", 0) == session]
    if shown and all("item_id" in s for s in shown):
        order = {item_id: i for i, item_id in enumerate(committed)}
        shown.sort(key=lambda s: order[s["item_id"]])
    return [s["text"] for s in shown]


def runs_of(names: list[str], sessions: int) -> list[list[str]]:
    """The drivers' split of the turns over --sessions K (livekit_realtime_stt.split): K runs of
    consecutive turns, the first ones a turn longer where K does not divide them."""
    size, extra = divmod(len(names), sessions)
    bounds = [k * size + min(k, extra) for k in range(sessions + 1)]
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


def run_sent(client_events: list[dict], runs: list[list[str]], silence_s: float) -> int:
    """Which run of turns one connection carried: the one whose audio its appends are the start of."""
    sent = np.concatenate(wire_items(client_events + [{"type": "input_audio_buffer.commit"}]))
    found = [k for k, run in enumerate(runs)
             if len(sent) and np.array_equal(session_audio(turns_pcm(run), silence_s)[: len(sent)], sent)]  # fmt: skip
    assert len(found) == 1, found
    return found[0]


# ----------------------------------------------------------------------------- live: the framework itself


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_framework_stt_service_unchanged_matches_ws(request, name, tmp_path):
    module, driver, turn_rate, silence_s, sessions = FRAMEWORKS[name]
    python = framework_python(module)  # before the server starts: a skip costs nothing
    demo_server = request.getfixturevalue("demo_server")
    names = [u.name for u in UTTERANCES]
    paths = []
    for i, t in enumerate(turns_pcm(names, turn_rate)):
        paths.append(tmp_path / f"turn{i}.pcm")
        paths[-1].write_bytes(t.tobytes())
    with WireRecorder(f"ws://127.0.0.1:{demo_server.port}") as rec:
        args = [a.format(ws=rec.ws_base, http=rec.http_base) for a in driver[1:]]
        run = subprocess.run([python, str(DRIVERS / driver[0]), *args, *map(str, paths)],
                             capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    # one connection per session: a framework that reconnected (the server closed on it) fails here
    assert len(rec.paths) == sessions and len(set(rec.paths)) == 1, (
        len(rec.paths), [e for e in rec.server_events() if e["type"] == "error"], run.stderr[-2000:])
    runs = runs_of(names, sessions)
    recorded = {}  # run -> (turns, script) as the relay saw them
    for c in range(sessions):
        script = wire_script(rec.client_events(c))
        # The items as the server got them: the framework's VAD put the commits (a turn it split or
        # merged is then two items or one, each still checked against /ws on its own audio), and
        # pipecat resampled 16 -> 24 kHz. Each item's completed event and each text the framework
        # shows against /ws on that audio.
        items = wire_items(rec.client_events(c))
        committed, references = check_completed_match_ws(demo_server, items, rec.server_events(c))
        k = 0
        if turn_rate == RATE:  # sent as given: the items are the test's own audio, cut at the commits
            k = run_sent(rec.client_events(c), runs, silence_s)
            own = committed_items(script, session_audio(turns_pcm(runs[k]), silence_s))
            assert all(np.array_equal(a, b) for a, b in zip(items, own, strict=True))
        # What the framework hands its pipeline (pipecat's TranscriptionFrame.text, livekit's FINAL_TRANSCRIPT
        # text), per item, against /ws on that item's audio: not against the relay's copy of the server's event.
        shown = shown_texts(run.stdout, committed, k)
        assert shown == [text for _, text in references if text], run.stdout[-2000:]
        recorded[k] = {"turns": runs[k], "script": compress(script)}
    assert sorted(recorded) == list(range(sessions))  # every run of turns on a connection of its own
    recording = {"client": CLIENT_LABELS[name], "path": rec.paths[0].replace(TOKEN, "TOKEN"), "turns": names,
                 "silence_after_turn_s": silence_s}  # fmt: skip
    if sessions == 1:
        recording["script"] = recorded[0]["script"]
    else:
        recording["sessions"] = [recorded[k] for k in range(sessions)]
    target = RECORDINGS / f"{name}.json"
    if os.environ.get("NEMO_SERVE_RECORD_WIRE"):
        target.write_text(dump_recording(recording))
    saved = json.loads(target.read_text())
    # what the replay test sends is what this version of the framework sends: the same events
    # and append sizes (a VAD's commit points may move by a few appends from run to run)
    assert shape(recording) == shape(saved), "the framework's wire changed: rerun with NEMO_SERVE_RECORD_WIRE=1"


def dump_recording(recording: dict) -> str:
    """JSON with one line per field and per script entry (a run of appends is one line)."""
    def script_lines(script: list[dict], indent: str) -> str:
        return ",\n".join(f"{indent}{json.dumps(e)}" for e in script)

    head = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in recording.items() if k not in ("script", "sessions")]
    if "script" in recording:
        return "{\n" + ",\n".join(head) + ',\n "script": [\n' + script_lines(recording["script"], "  ") + "\n ]\n}\n"
    sessions = ",\n".join(f'  {{"turns": {json.dumps(s["turns"])}, "script": [\n' + script_lines(s["script"], "   ") + "\n  ]}"
                           for s in recording["sessions"])  # fmt: skip
    return "{\n" + ",\n".join(head) + ',\n "sessions": [\n' + sessions + "\n ]\n}\n"


def compress(script: list[dict]) -> list[dict]:
    """Runs of appends as {"append_samples": [...]}, so a recording stays small and readable."""
    out: list[dict] = []
    for e in script:
        if e["type"] == "input_audio_buffer.append":
            if not out or "append_samples" not in out[-1]:
                out.append({"append_samples": []})
            out[-1]["append_samples"].append(e["samples"])
        else:
            out.append(e)
    return out


def expand(compressed: list[dict]) -> list[dict]:
    script = []
    for e in compressed:
        if "append_samples" in e:
            script += [{"type": "input_audio_buffer.append", "samples": n} for n in e["append_samples"]]
        else:
            script.append(e)
    return script


def sessions_of(recording: dict) -> list[tuple[list[str], list[dict]]]:
    """(turns, expanded script) per recorded session; a recording of one session keeps its script at the top."""
    if "sessions" in recording:
        return [(s["turns"], expand(s["script"])) for s in recording["sessions"]]
    return [(recording["turns"], expand(recording["script"]))]


def shape(recording: dict) -> dict:
    return {
        "path": recording["path"],
        "sessions": [{
            "turns": turns,
            "control": [e for e in script if e["type"] != "input_audio_buffer.append"],
            "append_sizes": sorted({e["samples"] for e in script if e["type"] == "input_audio_buffer.append"}),
        } for turns, script in sessions_of(recording)],
    }  # fmt: skip


def test_wire_items_and_shown_texts_follow_the_wire_not_the_turns():
    """What the live test (skipped where the framework is missing) compares rests on these two:
    an item is every append since the last commit, however the VAD cut the turns (one turn split
    in two here), and printed texts are put in commit order by their item id."""
    def append(*samples: int) -> dict:
        audio = base64.b64encode(np.array(samples, "<i2").tobytes()).decode()
        return {"type": "input_audio_buffer.append", "audio": audio}

    commit = {"type": "input_audio_buffer.commit"}
    events = [append(1, 2), append(3), commit, append(4), commit, append(5, 6), commit, append(7)]
    assert [i.tolist() for i in wire_items(events)] == [[1, 2, 3], [4], [5, 6]]  # 7: never committed
    stdout = "\n".join(json.dumps({"text": t, "item_id": i}) for t, i in [("b", "item_b"), ("a", "item_a")])
    assert shown_texts(stdout, ["item_a", "item_b"]) == ["a", "b"]
    with pytest.raises(KeyError):  # a frame for an item nobody committed
        shown_texts(stdout, ["item_a"])
    # livekit's sessions at once: each session's texts apart, each session's turns consecutive
    stdout = "\n".join(json.dumps({"session": k, "text": t}) for k, t in [(1, "x"), (0, "a"), (1, "y"), (0, "b")])
    assert shown_texts(stdout, [], 0) == ["a", "b"] and shown_texts(stdout, [], 1) == ["x", "y"]
    assert runs_of(list("abcdefg"), 3) == [list("abc"), list("de"), list("fg")]


# ----------------------------------------------------------------------------- replay: the recorded wire


async def replay(server, path: str, script: list[dict], audio: np.ndarray) -> list[dict]:
    """Send one session's recorded events over a real WebSocket, appends filled with the session's
    audio; every server event until one `completed` per commit."""
    commits = sum(e["type"] == "input_audio_buffer.commit" for e in script)
    url = f"ws://127.0.0.1:{server.port}{path}"
    events: list[dict] = []
    async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {TOKEN}"}, max_size=None) as ws:

        async def receive() -> None:
            async for text in ws:
                events.append(json.loads(text))
                if sum(e["type"] == COMPLETED for e in events) == commits or events[-1]["type"] == "error":
                    return

        receiving = asyncio.create_task(receive())
        pos = 0
        for e in script:
            if e["type"] == "input_audio_buffer.append":
                chunk = audio[pos : pos + e["samples"]]
                pos += e["samples"]
                e = {"type": e["type"], "audio": base64.b64encode(chunk.tobytes()).decode()}
            await ws.send(json.dumps(e))
        async with asyncio.timeout(120):
            await receiving
    return events


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_replayed_framework_wire_matches_ws(demo_server, name):
    """Each recorded session (livekit's four ran at once: so does their replay) against /ws."""
    recording = json.loads((RECORDINGS / f"{name}.json").read_text())
    sessions = sessions_of(recording)
    assert [t for turns, _ in sessions for t in turns] == recording["turns"]
    audios = [session_audio(turns_pcm(turns), recording["silence_after_turn_s"]) for turns, _ in sessions]

    async def every_session() -> list[list[dict]]:
        return await asyncio.gather(*(replay(demo_server, recording["path"], script, audio)
                                      for (_, script), audio in zip(sessions, audios)))  # fmt: skip

    for (turns, script), audio, events in zip(sessions, audios, asyncio.run(every_session())):
        check_items_match_ws(demo_server, script, audio, events, len(turns))

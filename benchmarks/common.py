"""Shared pieces of the benchmarks: which model file, which audio, and what to record about the run.

Every benchmark loads its model from one `.nemo` file, so the engine, NeMo's pipeline (which
restores its own copy from a path), the per-stream loop and the ONNX export all see the same
weights. A built-in architecture (`builtin:NAME`) is built once and cached as a `.nemo`, keyed
by the source of the builtin package and of the calibration audio, its config and the torch /
NeMo versions (building FastConformer-L with its weight calibration takes minutes).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from nemo_serve.audio_io import load_manifest

REPO = Path(__file__).resolve().parent.parent
CACHE_DIR = Path(os.environ.get("NEMO_SERVE_BENCH_CACHE", Path.home() / ".cache" / "nemo_serve" / "bench"))
SAMPLE_RATE = 16000


# ----------------------------------------------------------------------------- model files


def model_file(spec: str | None) -> tuple[Path, str]:
    """(path to a .nemo, display name) for a model spec: a .nemo path, `builtin:NAME`, or None (demo)."""
    from nemo_serve.model import DEMO_MODEL_PATH

    if spec is None or spec == "demo":
        if not DEMO_MODEL_PATH.exists():
            raise SystemExit(f"the embedded demo model is not there yet ({DEMO_MODEL_PATH})")
        return DEMO_MODEL_PATH, "demo"
    if spec.endswith(".nemo"):
        return Path(spec), Path(spec).stem
    name = spec.removeprefix("builtin:")
    return _cached_builtin(name), f"builtin:{name}"


def _cached_builtin(name: str, seed: int = 0) -> Path:
    import nemo
    import torch

    from nemo_serve import builtin, synth
    from nemo_serve.config_files import config_dir

    h = hashlib.sha256()
    for source in sorted(Path(builtin.__file__).parent.glob("*.py")) + [Path(synth.__file__)]:
        h.update(source.read_bytes())
    h.update((config_dir() / f"{name}.yaml").read_bytes())
    h.update(f"{seed}:{torch.__version__}:{nemo.__version__}".encode())
    path = CACHE_DIR / f"{name}-{h.hexdigest()[:12]}.nemo"
    if not path.exists():
        print(f"building {name} (cached afterwards as {path}) ...", file=sys.stderr, flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        model = builtin.build_builtin(name, seed=seed)
        tmp = path.with_suffix(".tmp.nemo")
        model.save_to(str(tmp))
        tmp.rename(path)
    return path


def file_digest(path: str | Path, length: int = 12) -> str:
    """First `length` hex digits (64: all) of the file's sha256: which weights a result was measured on."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:length]


# ----------------------------------------------------------------------------- audio


def bench_audio(num_streams: int, seconds: float, source: str = "synth") -> list[np.ndarray]:
    """`num_streams` float32 clips of `seconds` each; stream i gets clip i mod 8 (same set for every system).

    source "synth": nemo_serve.synth.synth_audio (speech-like, for random-weight models);
    a manifest path (NeMo jsonl with audio_filepath): the utterances concatenated from a different
    starting utterance per clip, with 0.3 s pauses, cut to `seconds`.
    """
    num_clips = min(num_streams, 8)
    if source == "synth":
        from nemo_serve.synth import synth_audio

        clips = [synth_audio(seconds, seed=7000 + i).numpy() for i in range(num_clips)]
    else:
        utts = [audio for _, audio in load_manifest(source, SAMPLE_RATE)]
        clips = [_concat_from(utts, i * max(1, len(utts) // num_clips), seconds) for i in range(num_clips)]
    return [clips[i % num_clips] for i in range(num_streams)]


def _concat_from(utts: list[np.ndarray], start: int, seconds: float) -> np.ndarray:
    need = int(seconds * SAMPLE_RATE)
    pause = np.zeros(int(0.3 * SAMPLE_RATE), dtype=np.float32)
    parts, n, k = [], 0, start
    while n < need:
        a = utts[k % len(utts)]
        parts += [a, pause]
        n += len(a) + len(pause)
        k += 1
    return np.concatenate(parts)[:need].astype(np.float32)


# ----------------------------------------------------------------------------- run record


def run_record() -> dict:
    """What every results file carries: the exact command, when, on what, and how busy the CPU was."""
    import torch

    # The results folder is left out: a run that writes results there must not call its own code dirty.
    changed = _git("status", "--porcelain", "--", "nemo_serve", "benchmarks", ":!benchmarks/results").splitlines()
    rec = {
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(changed),
        # which code differed from the commit, so "at <commit> (dirty)" still says what ran
        "git_dirty_files": [line.split(maxsplit=1)[1] for line in changed[:20]],
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    for mod in ("nemo", "onnxruntime", "sherpa_onnx", "onnx"):
        try:
            rec[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent optional package
            pass
    if torch.cuda.is_available():
        rec["gpu"] = torch.cuda.get_device_name(0)
        rec["cuda"] = torch.version.cuda
    return rec


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def write_json(path: str | Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def percentiles(values, qs=(50, 95, 99)) -> dict[str, float | None]:
    if len(values) == 0:
        return {f"p{q}": None for q in qs}
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


@contextlib.contextmanager
def local_server(*flags: str):
    """A nemo-serve on a free local port without a token (the server's defaults plus `flags`),
    once its /readyz answers 200 (up to 5 min); yields the port, stops the server after."""
    import httpx

    from benchmarks.server_process import free_port

    port = free_port()
    script = Path(sys.executable).with_name("nemo-serve")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "nemo_serve.cli"]
    env = {k: v for k, v in os.environ.items() if k != "NEMO_SERVE_AUTH_TOKEN"}  # no token: a local run
    proc = subprocess.Popen([*cmd, "--port", str(port), *flags, "--log-level", "warning"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield port
    finally:
        proc.terminate()
        proc.wait(30)

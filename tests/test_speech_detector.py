"""server/speech_detector.py: the model loads in a front end without torch."""

import subprocess
import sys


def test_detector_loads_without_importing_torch():
    # silero-vad's package __init__ imports torch: reaching its ONNX file through the package
    # blocked a front end's event loop for seconds at its first /v1/realtime session (handshakes
    # on it timed out under load) and loaded torch where the front ends never do.
    code = ("import sys; from nemo_serve.server import speech_detector as d; assert d.available(16000); "
            "d.SpeechDetector(16000); print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'silero_vad')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout

"""Export one chunk mode of a model for sherpa-onnx (what and how: benchmarks/onnx_export.py).

    python benchmarks/export_sherpa.py --model builtin:fastconformer-l --context-right 13 --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import model_file  # noqa: E402
from benchmarks.onnx_export import export  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:fastconformer-l", help=".nemo path, builtin:NAME, or demo")
    ap.add_argument("--context-right", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    path, _ = model_file(args.model)
    print(json.dumps(export(path, args.context_right, Path(args.out)), indent=1))


if __name__ == "__main__":
    main()

"""The benchmark caches are keyed on the weights' content: a retrained model file of the same name and size
(every retrained demo.nemo is) must not reuse an oracle or an ONNX export made from the old weights."""

from __future__ import annotations

import json

import numpy as np

from benchmarks import onnx_export
from benchmarks.common import file_digest
from benchmarks.load_items import LoadItem, oracle_cache_path


def _two_models(tmp_path):
    a, b = tmp_path / "a" / "demo.nemo", tmp_path / "b" / "demo.nemo"
    a.parent.mkdir()
    b.parent.mkdir()
    a.write_bytes(b"\x00" * 4096)
    b.write_bytes(b"\x00" * 4095 + b"\x01")  # same size, other weights
    return a, b


def test_oracle_cache_follows_the_weights(tmp_path):
    a, b = _two_models(tmp_path)
    items = [LoadItem("0", np.zeros(160, dtype=np.float32))]
    key = oracle_cache_path(a, items, 13, "fp32", "cpu")
    assert key == oracle_cache_path(a, items, 13, "fp32", "cpu")
    assert key != oracle_cache_path(b, items, 13, "fp32", "cpu")
    b.write_bytes(a.read_bytes())  # the same weights again: the same oracle
    assert key == oracle_cache_path(b, items, 13, "fp32", "cpu")
    assert key != oracle_cache_path(a, items, 3, "fp32", "cpu")
    assert key != oracle_cache_path(a, [LoadItem("0", np.ones(160, dtype=np.float32))], 13, "fp32", "cpu")


def test_onnx_export_is_redone_when_the_weights_change(tmp_path, monkeypatch):
    model, _ = _two_models(tmp_path)
    exported = []

    def fake_export(nemo_path, context_right, out):
        out.mkdir(parents=True, exist_ok=True)
        for f in onnx_export.MODEL_FILES:
            (out / f).write_text("x")
        (out / "export.json").write_text(json.dumps({"source": str(nemo_path), "source_sha256": file_digest(nemo_path)}))
        exported.append(file_digest(nemo_path))

    monkeypatch.setattr(onnx_export, "export", fake_export)
    root = tmp_path / "onnx"
    out = onnx_export.ensure_export(model, 13, root)
    assert onnx_export.ensure_export(model, 13, root) == out and len(exported) == 1  # reused
    model.write_bytes(b"\x02" * 4096)  # retrained in place, same name and size
    assert onnx_export.ensure_export(model, 13, root) == out and len(exported) == 2

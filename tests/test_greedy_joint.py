"""engine/greedy_joint.py: the joint's greedy labels without its log-softmax equal NeMo's joint's
argmax bit for bit, near ties included (where the log-softmax's rounding moves the first maximum),
and the label loop with it decodes as NeMo's computer does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from nemo.collections.asr.modules.rnnt import RNNTJoint

from nemo_serve.engine.greedy_joint import greedy_labels, joint_mode

from . import helpers
from .helpers_label_loop import SPECS, _chunks, _compare


def _identity_joint(log_softmax=None):
    """A joint whose net passes f + g through: the logits are what the test writes into f."""
    joint = SimpleNamespace(joint_net=torch.nn.Identity(), log_softmax=log_softmax, temperature=1.0, training=False,
                            masking_prob=0.0, preserve_memory=False, is_adapter_available=lambda: False)  # fmt: skip
    joint.joint_after_projection = lambda f, g: RNNTJoint.joint_after_projection(joint, f, g)
    return joint


def _nemo_labels(joint, f, g):
    return RNNTJoint.joint_after_projection(joint, f, g).squeeze(1).squeeze(1).max(-1)[1]


def _near_tie_logits(dtype, n=64, v=4097, seed=0):
    """Rows whose maximum sits at a higher index than a value one or two units in the last place
    below it, the rest of the row near the maximum too (L = log sum exp large): there the
    log-softmax rounds both to the same value and NeMo's argmax is the lower index."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, v, generator=gen) * 0.5
    top = 1.0 + torch.rand(n, generator=gen)
    x[:, 7] = top
    x = x.to(dtype)
    steps = torch.randint(1, 4, (n,), generator=gen)  # units in the last place below the maximum (in [1, 2))
    lower = (x[:, 7].float() - steps * torch.finfo(dtype).eps).to(dtype)  # exact in [1, 2)
    x[:, 3] = torch.where(steps == 3, x[:, 7] - 0.25, lower)  # a third of the rows: no near tie
    return x.view(n, 1, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_near_ties_give_nemos_label(dtype):
    joint = _identity_joint()
    f = _near_tie_logits(dtype)
    g = torch.zeros_like(f)
    ref = _nemo_labels(joint, f, g)
    raw = f.view(f.shape[0], -1).max(-1)[1]
    assert (ref != raw).sum() >= 5, "no row where the log-softmax moves the argmax: the test would not see a missing guard"
    assert torch.equal(greedy_labels(joint, f, g, mode="argmax"), ref)
    assert torch.equal(greedy_labels(joint, f, g, mode="full"), ref)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_trained_joint_labels_equal_nemos(dtype):
    """The demo model's joint on real encoder and predictor outputs, scaled to spread the logits."""
    model = helpers.model(None, None, dtype)
    joint = model.nemo.joint
    gen = torch.Generator().manual_seed(1)
    for scale in (0.1, 1.0, 5.0):
        f = (torch.randn(96, 1, joint.joint_hidden, generator=gen) * scale).to(model.dtype)
        g = (torch.randn(96, 1, joint.joint_hidden, generator=gen) * scale).to(model.dtype)
        with torch.inference_mode():
            assert torch.equal(greedy_labels(joint, f, g, mode="argmax"), _nemo_labels(joint, f, g)), scale


def test_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setenv("NEMO_SERVE_JOINT", "fast")
    with pytest.raises(ValueError, match="NEMO_SERVE_JOINT"):
        joint_mode()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("spec", SPECS[:2])
def test_label_loop_with_argmax_joint_equals_nemo(spec, dtype, monkeypatch):
    """The whole loop with NEMO_SERVE_JOINT=argmax: labels, timestamps and state bitwise NeMo's."""
    monkeypatch.setenv("NEMO_SERVE_JOINT", "argmax")
    model = helpers.model(spec, None, dtype)
    total = 0
    for scale, seed in ((1.0, 0), (4.0, 2)):
        total += _compare(model.decoding_computer, model, _chunks(model, b=7, t=5, n=4, scale=scale, seed=seed,
                                                                  spec=spec, dtype=dtype))  # fmt: skip
    assert total > 20

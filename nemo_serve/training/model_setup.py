"""The demo model as the recipe builds it: its config and tokenizer, depth growth (stacked layers from a
shallower checkpoint), the input convolution centred on the features' statistics, seeds."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from ..config_files import config_dir
from .eou import grow_state

DEFAULT_CONFIG = config_dir() / "demo_model.yaml"
DEFAULT_TOKENIZER = config_dir() / "demo_tokenizer"


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_tokenizer(text_file: Path, out_dir: Path, vocab_size: int = 128) -> None:
    from nemo.collections.common.tokenizers.sentencepiece_tokenizer import create_spt_model

    out_dir.mkdir(parents=True, exist_ok=True)
    create_spt_model(str(text_file), vocab_size=vocab_size, sample_size=-1, do_lower_case=True,
                     tokenizer_type="bpe", output_dir=str(out_dir))


def build_model(config: Path = DEFAULT_CONFIG, tokenizer_dir: Path = DEFAULT_TOKENIZER,
                encoder_layers: int | None = None):
    from omegaconf import OmegaConf, open_dict
    from nemo.collections.asr.models import EncDecHybridRNNTCTCBPEModel

    cfg = OmegaConf.load(str(config)).model
    with open_dict(cfg):
        cfg.tokenizer.dir = str(Path(tokenizer_dir).resolve())
        if encoder_layers:
            cfg.encoder.n_layers = encoder_layers
    return EncDecHybridRNNTCTCBPEModel(cfg=cfg)


def stack_layers(state: dict[str, torch.Tensor], n_src: int, n_new: int) -> dict[str, torch.Tensor]:
    """A deeper encoder from a trained one (progressive stacking): new layer i starts as a copy of trained
    layer ``i * n_src // n_new`` (4 -> 6: 0 0 1 2 2 3), so every new layer begins as a layer that works on
    the representation it will see, and fine-tuning starts near the trained model instead of from noise."""
    if n_new < n_src:
        raise ValueError(f"cannot stack {n_src} encoder layers into {n_new}")
    prefix = "encoder.layers."
    out = {k: v for k, v in state.items() if not k.startswith(prefix)}
    for i in range(n_new):
        src = f"{prefix}{i * n_src // n_new}."
        for k, v in state.items():
            if k.startswith(src):
                out[f"{prefix}{i}.{k[len(src):]}"] = v.clone()
    return out


def center_input_conv(model, mean: float, std: float) -> None:
    """Initialise the first subsampling conv so that it sees standardised log-mels.

    Streaming needs ``normalize: NA`` (no per-utterance statistics), so raw log-mels reach the encoder with
    mean ~ -11 and std ~ 3.6.  With NeMo's default init the first conv's pre-activations are then dominated by
    ``-11 * sum(w)``: about half of its ReLU channels start dead and the rest nearly linear, which stalls RNN-T
    training from scratch.  Folding a fixed affine standardisation into the conv's initial weight/bias
    (``w/std``, ``b - sum(w/std)*mean``) fixes that without changing the architecture or the streaming path.
    """
    conv = model.encoder.pre_encode.conv[0]
    with torch.no_grad():
        conv.weight.div_(std)
        conv.bias.sub_(conv.weight.sum(dim=tuple(range(1, conv.weight.dim()))) * mean)


def init_from(model, path: str) -> None:
    """Fine-tuning: copy every weight of a trained ``.nemo`` (same architecture and tokenizer) into ``model``;
    a deeper encoder (``--encoder-layers``) gets its layers by ``stack_layers``.  The optimiser starts fresh and
    the step count at 0 (use ``--ctc-warmup 0 --short-steps 0``)."""
    from nemo.collections.asr.models import ASRModel

    src = ASRModel.restore_from(str(path), map_location=torch.device("cpu"))
    state = src.state_dict()
    grown = model.tokenizer.vocab_size - src.tokenizer.vocab_size
    if grown > 0 and all(model.tokenizer.ids_to_tokens([src.tokenizer.vocab_size + i])[0].startswith("<")
                         for i in range(grown)):  # fmt: skip
        state = grow_state(state, src.tokenizer.vocab_size, grown)  # the EOU recipe (eou.py)
    elif grown:
        raise SystemExit(f"{path}: vocabulary {src.tokenizer.vocab_size}, expected {model.tokenizer.vocab_size}")
    n_src, n_new = len(src.encoder.layers), len(model.encoder.layers)
    if n_new != n_src:
        state = stack_layers(state, n_src, n_new)
    model.load_state_dict(state, strict=True)


def init_depth(path: str) -> int:
    """The encoder depth of a trained ``.nemo`` (from its config, without building it): a fine-tune keeps its
    model's depth unless ``--encoder-layers`` says otherwise."""
    from nemo.collections.asr.models import ASRModel

    return int(ASRModel.restore_from(str(path), return_config=True).encoder.n_layers)


def feature_stats(model, wavs, n: int = 200) -> tuple[float, float]:
    model.preprocessor.eval()
    feats = []
    with torch.no_grad():
        for w in wavs[:n]:
            x = torch.from_numpy(w.astype(np.float32) / 32768.0)[None]
            f, fl = model.preprocessor(input_signal=x, length=torch.tensor([x.shape[1]]))
            feats.append(f[0, :, : int(fl)])
    model.preprocessor.train()
    f = torch.cat(feats, 1)
    return float(f.mean()), float(f.std())

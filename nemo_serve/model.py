"""Load a NeMo cache-aware RNN-T model and describe what the engine needs of it.

`load_model` takes a local `.nemo`, a pretrained name (NeMo's `from_pretrained`),
or a built-in architecture (`builtin:NAME` or a bare name from configs/), puts it in
eval mode on the requested device and dtype, selects the chunk mode, and returns a
`ServedModel`: the NeMo module plus the chunk geometry, cache shapes, tokenizer
pieces and prompt dictionary the engine works from. Nothing here runs per step.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf, open_dict

from .engine.geometry import ChunkGeometry, UnsupportedModeError, language_index, parse_modes, served_geometry  # noqa: F401 - re-exported
from .nemo_private import blank_index, encoder_input_width

log = logging.getLogger(__name__)

DEMO_MODEL_PATH = Path(__file__).parent / "assets" / "demo" / "demo.nemo"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the message is one line that names the cause."""


@dataclass
class ServedModel:
    """A loaded model plus the facts the engine needs. Owned by the step loop once serving."""

    nemo: torch.nn.Module  # the NeMo ASRModel, eval mode
    name: str
    device: torch.device
    dtype: torch.dtype
    geometry: ChunkGeometry  # the default mode's (modes[0])
    trained_context_right: tuple[int, ...]
    preprocessor: torch.nn.Module  # fp32, eval, dither 0, pad_to 0 (same recipe as NeMo's streaming buffer)
    num_mels: int
    cache_shapes: tuple[tuple[int, ...], tuple[int, ...]]  # per stream: [L, C, D], [L, D, K-1]
    blank_id: int
    vocabulary: list[str]  # id -> piece ("▁the") or character
    is_bpe: bool
    prompt_dictionary: dict[str, int] | None  # language code -> prompt index (prompt models only)
    num_prompts: int
    default_language: str | None
    num_parameters: int
    # Every mode this server serves (right contexts; the first is the default) and its geometry.
    geometries: dict[int, ChunkGeometry] = field(default_factory=dict)
    # NeMo's encoder keeps one mode in module state (att_context_size, streaming_cfg): whoever runs
    # NeMo's own step (NeMo's loop, NemoEncoder) switches it under this lock (`nemo_mode`).
    _mode_lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def __post_init__(self) -> None:
        if not self.geometries:
            self.geometries = {self.geometry.context_right: self.geometry}

    @property
    def modes(self) -> tuple[int, ...]:
        return tuple(self.geometries)

    def geometry_for(self, context_right: int | None) -> ChunkGeometry:
        """The geometry of a served mode (None -> the default); ValueError lists the served ones."""
        return served_geometry(self.geometries, self.geometry, context_right)

    @contextlib.contextmanager
    def nemo_mode(self, context_right: int | None):
        """NeMo's encoder set to this mode for the duration (serialised: its mode is module state)."""
        g = self.geometry_for(context_right)
        with self._mode_lock:
            enc = self.nemo.encoder
            want = [g.context_left, g.context_right]
            if list(enc.att_context_size) != want:
                enc.set_default_att_context_size(want)
            yield g

    @property
    def decoding_computer(self):
        return self.nemo.decoding.decoding.decoding_computer

    @property
    def cache_bytes_per_stream(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return sum(math.prod(s) for s in self.cache_shapes) * elem

    def language_index(self, language: str | None) -> int:
        """Prompt index for `language` (None -> default); raises ValueError with the valid codes."""
        return language_index(self.prompt_dictionary, self.default_language, language)

    def summary(
        self, num_slots: int, cache_bytes_per_stream: int | None = None, attention_cache: str = "", memory: str = ""
    ) -> str:
        """One line for the log; the engine passes its own cache size (its layout may differ) and
        its slot pool's memory line (`SlotPool.memory_summary`)."""
        g = self.geometry
        per = cache_bytes_per_stream or self.cache_bytes_per_stream
        layout = f" ({attention_cache})" if attention_cache else ""
        modes = ""
        if len(self.geometries) > 1:
            modes = " + " + ", ".join(f"[{m.context_left},{m.context_right}] {m.chunk_ms:.0f} ms" for m in list(self.geometries.values())[1:])
        return (
            f"model {self.name} ({type(self.nemo).__name__}, {self.num_parameters / 1e6:.1f}M params) "
            f"on {self.device} {str(self.dtype).replace('torch.', '')}; "
            f"att_context [{g.context_left},{g.context_right}] chunk {g.chunk_ms:.0f} ms (default){modes} "
            f"(trained right contexts {list(self.trained_context_right)}); "
            f"cache {per / 2**20:.2f} MiB/stream x {num_slots} slots = {per * num_slots / 2**20:.1f} MiB{layout}"
            + (f"; {memory}" if memory else "")
        )


# ----------------------------------------------------------------------------- loading


def _restore(path: str, device: torch.device):
    from nemo.collections.asr.models import ASRModel

    if not os.path.exists(path):
        raise ModelLoadError(f"model file not found: {path}")
    try:
        return ASRModel.restore_from(path, map_location=device)
    except Exception as e:  # noqa: BLE001 - one clear line instead of a NeMo traceback
        raise ModelLoadError(f"could not restore {path}: {type(e).__name__}: {e}") from e


def _from_pretrained(name: str, device: torch.device):
    from nemo.collections.asr.models import ASRModel

    try:
        return ASRModel.from_pretrained(name, map_location=device)
    except Exception as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(
            f"could not fetch pretrained model {name!r} (no network access to the model hub, or unknown name): "
            f"{type(e).__name__}: {msg[:200]}. Pass a local .nemo file with --model PATH instead."
        ) from e


def _load_nemo(spec: str, device: torch.device):
    from . import builtin

    if spec.endswith(".nemo"):
        return _restore(spec, device), Path(spec).stem
    name = spec.removeprefix("builtin:")
    if spec.startswith("builtin:") or builtin.is_builtin(name):
        return builtin.build_builtin(name).to(device), f"builtin:{name}"
    return _from_pretrained(spec, device), spec


def _trained_context_right(encoder) -> tuple[int, ...]:
    modes = getattr(encoder, "att_context_size_all", None) or [encoder.att_context_size]
    return tuple(int(m[1]) for m in modes)


def _select_modes(encoder, context_right) -> list[list[int]]:
    """[[L, R], ...] for --context-right (None, an int, a list, "all"); the first is the default."""
    trained = [list(map(int, m)) for m in (getattr(encoder, "att_context_size_all", None) or [encoder.att_context_size])]
    wanted = parse_modes(context_right)
    if wanted is None:
        return trained[:1]
    if wanted == "all":
        return trained
    by_right = {m[1]: m for m in trained}
    for r in wanted:
        if r not in by_right:
            valid = ", ".join(str(m[1]) for m in trained)
            raise UnsupportedModeError(f"--context-right {r} is not a mode this model was trained for; valid values: {valid}")
    return [by_right[r] for r in wanted]


def _check_streamable(nemo) -> None:
    from nemo.collections.asr.models import EncDecRNNTModel
    from nemo.collections.asr.parts.mixins.streaming import StreamingEncoder

    if not isinstance(nemo, EncDecRNNTModel):
        raise ModelLoadError(f"{type(nemo).__name__} is not an RNN-T model (EncDecRNNTModel family)")
    if not isinstance(nemo.encoder, StreamingEncoder) or nemo.encoder.att_context_style != "chunked_limited":
        raise ModelLoadError("the encoder is not a cache-aware chunked_limited streaming encoder")
    norm = str(nemo.cfg.preprocessor.get("normalize", "NA"))
    if norm not in ("NA", "None", "none", ""):
        raise ModelLoadError(f"preprocessor.normalize={norm!r} needs whole-utterance statistics; cannot stream exactly")


def _use_greedy_label_looping(nemo) -> None:
    """Greedy batched label-looping decoding: the only NeMo RNN-T decoder that carries state across chunks."""
    from nemo.collections.asr.models import EncDecHybridRNNTCTCModel

    cfg = copy.deepcopy(nemo.cfg.decoding)
    with open_dict(cfg):
        cfg.strategy = "greedy_batch"
        cfg.greedy.max_symbols = cfg.greedy.get("max_symbols", None) or 10
        cfg.greedy.loop_labels = True
        cfg.preserve_alignments = False
        cfg.fused_batch_size = -1
    if isinstance(nemo, EncDecHybridRNNTCTCModel):
        nemo.change_decoding_strategy(decoding_cfg=cfg, decoder_type="rnnt", verbose=False)
    else:
        nemo.change_decoding_strategy(decoding_cfg=cfg, verbose=False)


def make_preprocessor(nemo, device: torch.device) -> torch.nn.Module:
    """The feature extractor NeMo's CacheAwareStreamingAudioBuffer builds: fresh, dither 0, pad_to 0, eval."""
    cfg = copy.deepcopy(nemo.cfg.preprocessor)
    OmegaConf.set_struct(cfg, False)
    cfg.dither = 0.0
    cfg.pad_to = 0
    pre = nemo.from_config_dict(cfg)
    return pre.to(device).eval()


def _geometry(nemo, mode: list[int]) -> ChunkGeometry:
    enc = nemo.encoder
    cfg = enc.streaming_cfg
    sampling = enc.pre_encode.get_sampling_frames()
    pre = nemo.cfg.preprocessor
    sr = int(pre.get("sample_rate", 16000))
    hop = int(round(float(pre.get("window_stride", 0.01)) * sr))
    return ChunkGeometry(
        context_left=mode[0],
        context_right=mode[1],
        first_frames=int(cfg.chunk_size[0]),
        chunk_frames=int(cfg.chunk_size[1]),
        pre_cache_frames=int(cfg.pre_encode_cache_size[1]),
        drop_frames=int(cfg.drop_extra_pre_encoded),
        min_first_frames=int(sampling[0]),
        min_later_frames=int(sampling[1]),
        hop_samples=hop,
        sample_rate=sr,
        subsampling=int(enc.subsampling_factor),
    )


def _vocabulary(nemo) -> tuple[list[str], bool]:
    tok = getattr(nemo, "tokenizer", None)
    if tok is not None:
        return [tok.ids_to_tokens([i])[0] for i in range(tok.vocab_size)], True
    return list(nemo.joint.vocabulary), False


def _prompts(nemo) -> tuple[dict[str, int] | None, int, str | None]:
    if not getattr(nemo, "concat", False) or not hasattr(nemo, "prompt_kernel"):
        return None, 0, None
    d = nemo.cfg.model_defaults.get("prompt_dictionary", None)
    if not d:
        raise ModelLoadError("prompt model without model_defaults.prompt_dictionary")
    d = {str(k): int(v) for k, v in OmegaConf.to_container(d).items()}
    default = "en-US" if "en-US" in d else sorted(d)[0]
    return d, int(nemo.num_prompts), default


def load_model(
    spec: str | None = None,
    *,
    context_right: int | list[int] | str | None = None,
    dtype: str = "fp32",
    device: str = "cpu",
) -> ServedModel:
    """Load `spec` (None -> the embedded demo model) and prepare it for serving its chunk modes:
    `context_right` is one right context, a list ("0,3,13" or [0, 3, 13]; the first is the default)
    or "all" (every trained mode, the model's first as default); None: the model's first mode."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda requested but CUDA is not available")
    if spec is None:
        spec = str(DEMO_MODEL_PATH) if DEMO_MODEL_PATH.exists() else "builtin:tiny-hybrid"
    nemo, name = _load_nemo(spec, dev)
    _check_streamable(nemo)
    nemo.eval()
    modes = _select_modes(nemo.encoder, context_right)
    geometries = {}
    for mode in reversed(modes):  # the default (first) is set last and stays set
        nemo.encoder.set_default_att_context_size(mode)
        geometries[mode[1]] = _geometry(nemo, mode)
    geometries = {m[1]: geometries[m[1]] for m in modes}
    _use_greedy_label_looping(nemo)
    nemo.to(DTYPES[dtype])
    # Our own fp32 preprocessor; the model's copy was cast with the weights.
    preprocessor = make_preprocessor(nemo, dev)
    enc = nemo.encoder
    n_layers, d_model = len(enc.layers), enc.d_model
    k_minus_1 = enc.conv_context_size[0]
    cache_len = enc.streaming_cfg.last_channel_cache_size
    vocab, is_bpe = _vocabulary(nemo)
    prompts, num_prompts, default_lang = _prompts(nemo)
    return ServedModel(
        nemo=nemo,
        name=name,
        device=dev,
        dtype=DTYPES[dtype],
        geometry=geometries[modes[0][1]],
        geometries=geometries,
        trained_context_right=_trained_context_right(enc),
        preprocessor=preprocessor,
        num_mels=encoder_input_width(enc),
        cache_shapes=((n_layers, cache_len, d_model), (n_layers, d_model, k_minus_1)),
        blank_id=blank_index(nemo.decoding.decoding.decoding_computer),
        vocabulary=vocab,
        is_bpe=is_bpe,
        prompt_dictionary=prompts,
        num_prompts=num_prompts,
        default_language=default_lang,
        num_parameters=sum(p.numel() for p in nemo.parameters()),
    )

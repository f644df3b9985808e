"""Built-in model architectures with seeded random weights, for tests and benchmarks.

`build_builtin(name, seed=0)` builds one of `BUILTIN_NAMES` from `configs/<name>.yaml` (a NeMo
`model:` section, the NeMo class as `target:`, our `tokenizer:` and `random_init:` recipes)
and returns the NeMo model in eval mode, on CPU, in fp32. All are cache-aware FastConformer
transducers (dw_striding x8 causal subsampling, causal convs, kernel 9, chunked_limited
rel-pos attention, several trained right contexts; greedy_batch label looping, max_symbols 10):

  tiny-char        EncDecRNNTModel, 28 characters, 2 layers x 64, 80 mels, L 56, R {13,6,3,0}
  tiny-hybrid      EncDecHybridRNNTCTCBPEModel, 64 BPE pieces, 2 x 64, 80 mels, L 70, R {13,6,1,0}
  tiny-prompt      EncDecRNNTBPEModelWithPrompt, 128 pieces, 8 prompts (en-US, de-DE, fr-FR, es-ES),
                   2 x 64, 128 mels, L 56, R {13,6,3,0}
  fastconformer-l  the stt_en_fastconformer_hybrid_large_streaming_multi architecture: hybrid,
                   17 x 512, 8 heads, 80 mels, L 70, R {13,6,1,0}, LSTM 640, joint 640, 1024 pieces
  nemotron-0.6b    the Nemotron 3.5 ASR streaming 0.6B architecture: prompt model, 24 x 1024,
                   8 heads, 128 mels, L 56, R {13,6,3,0}, 2-layer LSTM 640, joint 640,
                   128 prompts (32 language codes), 13,087 pieces incl. <unk> + blank = 13,088
                   joint outputs (a [13,088 x 640] output layer)

Tokenizers are SentencePiece BPE trained with NeMo's own create_spt_model (which also writes
the vocab.txt NeMo needs) on Zipf-distributed pseudo-words generated in code, and cached in
~/.cache/nemo_serve/tokenizers/<name>-<hash of the recipe>/ ($NEMO_SERVE_CACHE moves it);
the 13,087-piece one trains in about a second. The same name and seed give the same weights
with the same torch and NeMo on the same machine; other CPUs may differ in the last bits of
the calibration and so, rarely, in a decision: ship a .nemo (save_to) when two machines
must agree.

Why the weights are shaped. With NeMo's random init the greedy decoder emits max_symbols
tokens on every frame, so token parity on it proves little and it costs a server far more
decoder work than a real model. After NeMo's init (LayerNorm gains/biases and pos_bias_u/v
randomised too, so that a runtime that drops one of them cannot match) the joint and the
predictor are rebuilt around "token groups" that stand in for acoustic content:
- the joint's encoder side reads whitened random directions of the encoder (or, for prompt
  models, prompt_kernel) output: one "evidence" unit per group (unit variance on generated
  calibration audio), a saturating distance from near-silence, and random units that pick
  the token inside a group; the directions are orthogonal to how silence moves (with the
  language, at the start and end of an utterance) and to how the context mode shifts the
  same audio, so silence reads as silence and the rate hardly depends on the mode;
- the LSTM predictor carries two one-hot registers: the groups of the last two labels (the
  second copied through the recurrent weights: state an engine must carry exactly); its
  other units keep NeMo's random weights with a short memory;
- token k's logit is its group's evidence, minus a large penalty while its group is one of
  the last two (no stutter, no cycles), plus a label-context dependent term; the blank's is
  a bias, plus the current evidence of the last two groups ("this content was emitted"),
  plus a bonus near silence; some groups have a follower group that gets a boost right
  after them, so 15-30% of emitting frames carry 2-3 tokens; <unk> sits at -40;
- the blank bias is bisected (all candidates decoded as one batch by `simulate_greedy`)
  so that `target_emitting_frames` of the calibration frames emit;
- prompt models: the one-hot columns of prompt_kernel's first layer are scaled to move its
  hidden units by `prompt_scale` x their spread over frames, so the language changes the
  tokens but hardly the rate; hybrid models: the CTC head is a whitened random projection
  with its blank bias at the matching quantile.
A frame then emits when its content (best group) changes to one not just emitted, mostly
one token at a time, and silence emits nothing; outputs change with the chunk mode and the
language. It is a parity and performance stand-in (the emission rate drives decoder cost),
not a recogniser: its text is gibberish.

Measured (CPU, 2 shared cores, torch 2.13, NeMo 3.0.0, seed 0; emission on 3 x 8 s of
synthetic audio the calibration never saw, NeMo's own offline chunked-limited decoding):

  name             parameters   build s  construct/encode/joint s  emitting frames  tokens/frame  distinct
  tiny-char           272,861       4        0.6 /  1.5 /  1.9         0.25-0.28       0.32-0.37     23-27 /  28
  tiny-hybrid         281,730       4        1.0 /  1.4 /  1.7         0.28-0.30       0.36-0.38     39-42 /  64
  tiny-prompt         315,649       5        0.9 /  1.6 /  2.0         0.29-0.38       0.39-0.51     58-75 / 128
  fastconformer-l 114,752,514      45        7   / 15   / 23           0.29-0.36       0.35-0.43    93-117 / 1024
  nemotron-0.6b   638,439,456      82       23   / 21   / 38           0.22-0.39       0.29-0.54    87-156 / 13087
Ranges are over the trained modes and, for prompt models, en-US, de-DE and fr-FR or es-ES;
"distinct" counts different tokens among the 90-160 emitted per mode, over the vocabulary.
The first build in a process also pays 10-25 s of NeMo import, and the machine's load
average was 4-6 on its 2 cores: an idle machine is faster. 70-85% of emitting frames carry
one token, the rest two or three; frames with 4+ are under 1%. Near-silence emits nothing
after the first second except, sometimes, on the last frame. Nemotron's construct time is
NeMo's own: each copy of a 13k-entry label list through OmegaConf costs about a second and
the constructor makes dozens; restore_from of the real model pays it too.
`python -m nemo_serve.builtin [NAME ...]` re-measures.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

BUILTIN_NAMES = ("tiny-char", "tiny-hybrid", "tiny-prompt", "fastconformer-l", "nemotron-0.6b")

SAMPLE_RATE = 16000
CONFIG_DIR = Path(os.environ.get("NEMO_SERVE_CONFIG_DIR", Path(__file__).resolve().parent.parent / "configs"))
CACHE_DIR = Path(os.environ.get("NEMO_SERVE_CACHE", Path.home() / ".cache" / "nemo_serve"))

# Part of the tokenizer cache key: bump when _pseudo_word_corpus or the trainer options change.
_TOKENIZER_RECIPE_VERSION = 1
# Calibration audio seeds live far from the small seeds tests use for their own audio.
_CALIBRATION_AUDIO_SEED = 0xCA1B
_UNK_LOGIT = -40.0

log = logging.getLogger(__name__)


def is_builtin(name: str) -> bool:
    return name in BUILTIN_NAMES


def builtin_spec(name: str) -> DictConfig:
    """The whole yaml of a built-in: `target`, `model`, and our `tokenizer` / `random_init` recipes."""
    if not is_builtin(name):
        raise ValueError(f"unknown built-in model {name!r}; choose one of: {', '.join(BUILTIN_NAMES)}")
    path = CONFIG_DIR / f"{name}.yaml"
    if not path.exists():
        raise FileNotFoundError(f"built-in config {path} is missing (NEMO_SERVE_CONFIG_DIR names the configs/ folder)")
    return OmegaConf.load(path)


def build_builtin(name: str, seed: int = 0):
    """Build the named architecture with seeded, non-degenerate random weights (eval mode, CPU, fp32).

    Same name, seed, torch and NeMo versions on the same machine give the same weights, whatever
    the caller's torch thread count.
    """
    timings: dict[str, float] = {}
    with _phase(timings, "total"):
        spec = builtin_spec(name)
        cfg = spec.model.copy()
        if "tokenizer" in spec:
            with _phase(timings, "tokenizer"), open_dict(cfg):
                cfg.tokenizer.dir = str(ensure_tokenizer(name, spec.tokenizer))
                cfg.tokenizer.type = spec.tokenizer.type
        cls = _import_class(spec.target)
        with _phase(timings, "construct"), _quiet_nemo(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = cls(cfg=cfg)
        model = model.to(device="cpu", dtype=torch.float32).eval()
        recipe = _RandomInitRecipe(**OmegaConf.to_container(spec.get("random_init", {})))
        gen = torch.Generator().manual_seed(_derived_seed(name, seed))
        # One thread: the calibration's float results (and so the weights) must not depend on the
        # caller's thread count, or a server and a test process would build different models.
        with torch.no_grad(), _quiet_nemo(), _torch_threads(1):
            _shape_weights(model, recipe, gen, timings)
    num_params = sum(p.numel() for p in model.parameters())
    log.info(
        "built %s (seed %d): %.1fM parameters in %.1f s (%s)", name, seed, num_params / 1e6, timings["total"],
        ", ".join(f"{k} {v:.1f}" for k, v in timings.items() if k != "total"),
    )
    return model


# --------------------------------------------------------------------------- tokenizers


def ensure_tokenizer(name: str, recipe: DictConfig) -> Path:
    """Directory holding tokenizer.model, tokenizer.vocab and vocab.txt for a recipe; trained once, then cached.

    Trained with NeMo's own create_spt_model (which also writes the vocab.txt NeMo requires)
    on a pseudo-word corpus generated in code. Written to a temp dir and renamed, so that
    concurrent builders never see half a tokenizer.
    """
    recipe_dict = OmegaConf.to_container(recipe, resolve=True)
    key = json.dumps({"v": _TOKENIZER_RECIPE_VERSION, **recipe_dict}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    final_dir = CACHE_DIR / "tokenizers" / f"{name}-{digest}"
    if (final_dir / "vocab.txt").exists():
        return final_dir
    from nemo.collections.common.tokenizers.sentencepiece_tokenizer import create_spt_model

    final_dir.parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final_dir.parent))
    try:
        corpus_path = work_dir / "corpus.txt"
        corpus_path.write_text(
            _pseudo_word_corpus(
                recipe.lexicon_size, recipe.corpus_words, recipe.get("extra_letters", ""), recipe.get("seed", 0)
            ),
            encoding="utf-8",
        )
        out_dir = work_dir / "tokenizer"
        with _quiet_nemo(), _quiet_fds():
            create_spt_model(
                str(corpus_path),
                vocab_size=recipe.vocab_size,
                sample_size=-1,
                do_lower_case=False,
                tokenizer_type=recipe.type,
                output_dir=str(out_dir),
                character_coverage=1.0,
            )
        num_pieces = sum(1 for _ in open(out_dir / "tokenizer.vocab", encoding="utf-8"))
        if num_pieces != recipe.vocab_size:
            # create_spt_model passes hard_vocab_limit=false: a corpus too small silently gives fewer pieces.
            raise RuntimeError(f"{name}: tokenizer has {num_pieces} pieces, recipe asks {recipe.vocab_size}")
        (out_dir / "recipe.json").write_text(key)
        try:
            os.rename(out_dir, final_dir)
        except OSError:
            if not (final_dir / "vocab.txt").exists():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return final_dir


def _pseudo_word_corpus(lexicon_size: int, num_words: int, extra_letters: str, seed: int) -> str:
    """Deterministic text of Zipf-distributed pseudo-words built from syllables: enough merges for BPE."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z"]
    onsets += ["br", "cr", "dr", "fr", "gr", "pr", "tr", "st", "sp", "sk", "sl", "pl", "bl", "cl", "fl"]
    onsets += ["gl", "ch", "sh", "th", "qu", "ph", "wh", "sn", "sm", "tw", "str"]
    vowels = ["a", "e", "i", "o", "u", "y", "ai", "ea", "ee", "oo", "ou", "ie", "au", "oi"] + list(extra_letters)
    codas = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "nt", "st", "rk", "ng", "ck", "x", "ll", "ss"]
    codas += ["rt", "ld", "mp", "'s"]
    lexicon: set[str] = set()
    while len(lexicon) < lexicon_size:
        num_syllables = rng.choice([1, 1, 2, 2, 2, 3, 3, 4])
        lexicon.add("".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(num_syllables)))
    words = sorted(lexicon)
    rng.shuffle(words)
    weights = [1.0 / (rank + 10) ** 0.9 for rank in range(len(words))]
    stream = rng.choices(words, weights=weights, k=num_words)
    lines, i = [], 0
    while i < len(stream):
        n = rng.randint(4, 14)
        lines.append(" ".join(stream[i : i + n]))
        i += n
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- synthetic audio


def synth_audio(seconds: float, seed: int, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """Deterministic speech-like test signal [T] float32 in [-1, 1].

    A sequence of phone-length (50-300 ms) segments: voiced harmonic complexes with two
    formant-like peaks and pitch glides, noise bursts, chirps and pure tones, at varying
    levels, with pauses (200-800 ms of near-silence). Not speech; enough to move a random
    encoder around about as often as speech moves a trained one.
    """
    rng = np.random.default_rng(seed)
    num_samples = int(round(seconds * sample_rate))
    out = np.zeros(num_samples, dtype=np.float64)
    pos = 0
    while pos < num_samples:
        kind = rng.choice(["silence", "voiced", "voiced", "voiced", "voiced", "noise", "noise", "chirp", "tone"])
        seconds_here = rng.uniform(0.2, 0.8) if kind == "silence" else rng.uniform(0.05, 0.3)
        n = min(int(seconds_here * sample_rate), num_samples - pos)
        t = np.arange(n) / sample_rate
        if kind == "silence":
            seg = rng.normal(0.0, 1e-4, n)
        elif kind == "voiced":
            f0 = rng.uniform(90, 260) * (1 + rng.uniform(-0.15, 0.15) * t / max(t[-1], 1e-3))
            phase = 2 * np.pi * np.cumsum(f0) / sample_rate
            formants = rng.uniform([300, 900], [900, 2600])
            seg = np.zeros(n)
            for k in range(1, int(3800 / f0.max())):
                gain = sum(1.0 / (1.0 + ((k * f0.mean() - f) / 120.0) ** 2) for f in formants)
                seg += gain / k**0.5 * np.sin(k * phase)
            seg *= rng.uniform(0.05, 0.4) / (np.abs(seg).max() + 1e-9)
        elif kind == "noise":
            seg = rng.normal(0.0, 1.0, n)
            if rng.random() < 0.5:
                seg = np.diff(seg, prepend=0.0)  # brighter, fricative-like
            seg *= rng.uniform(0.01, 0.15)
        elif kind == "chirp":
            f_start, f_end = rng.uniform(150, 4000, size=2)
            phase = 2 * np.pi * (f_start * t + (f_end - f_start) * t**2 / (2 * max(t[-1], 1e-3)))
            seg = rng.uniform(0.02, 0.3) * np.sin(phase)
        else:
            seg = rng.uniform(0.02, 0.3) * np.sin(2 * np.pi * rng.uniform(100, 3000) * t)
        ramp = np.minimum(1.0, np.minimum(np.arange(n), np.arange(n)[::-1]) / (0.005 * sample_rate))
        out[pos : pos + n] = seg * ramp
        pos += n
    out += rng.normal(0.0, 3e-5, num_samples)  # no digital silence: log-mel of exact zeros is an outlier
    return torch.from_numpy(np.clip(out, -1.0, 1.0).astype(np.float32))


# --------------------------------------------------------------------------- weight shaping


@dataclass
class _RandomInitRecipe:
    """Knobs of the weight adjustment; defaults suit every built-in, a config's `random_init` may override."""

    target_emitting_frames: float = 0.32  # fraction of encoder frames with >= 1 token (calibration audio)
    calibration_utterances: int = 8  # 8 s each, round-robin over the context modes
    layer_norm_gain_std: float = 0.2  # log-normal LayerNorm gains
    layer_norm_bias_std: float = 0.1
    pos_bias_std: float = 0.3  # rel-pos attention pos_bias_u / pos_bias_v
    prompt_scale: float = 0.3  # language offsets in prompt_kernel's hidden units / their spread over frames
    tokens_per_group: float = 3.0  # vocabulary / number of token groups (see _JointLayout.make)
    lstm_forget_bias: float = -1.0  # free predictor units: short memory, about 1-2 labels
    group_scale: float = 4.0  # token logit per unit of its group's evidence
    gate_scale: float = 1.25  # blank logit per unit of a recent label's group evidence, / group_scale
    gate_sharpness: float = 4.0  # closed gates sit this many evidence stds below zero
    variation_scale: float = 1.0  # token logit scale of the within-group, label-context dependent part
    suppress: float = 1.0  # how hard the joint pushes down the labels just emitted
    repeat_penalty: float = 3.0  # token logit drop for the groups of the last two labels, / group_scale
    pred_noise: float = 0.8  # label-context-dependent variation
    silence_weight: float = 4.0  # blank logit at silence over a frame far from it (saturating distance)
    follow_fraction: float = 0.4  # groups with a follower group, emitted right after them (same frame)
    follow_margin: float = 2.0  # follower boost over the blank bias, / group_scale


@dataclass
class _JointLayout:
    """Which joint hidden units do what (slices into the joint hidden dimension H), and the token groups."""

    evidence: slice  # [G] group evidence e_j(t): whitened encoder directions, unit variance
    gate_last: slice  # [G] relu(e_j(t) - K * [group j is not the last label's]): about relu(e_j) or 0
    gate_prev: slice  # [G] the same for the label before the last
    last_flag: slice  # [G] 1 while the last label is of group j, else 0
    prev_flag: slice  # [G] 1 while the label before the last is of group j, else 0
    silence: slice  # [4P] relu(+-a_i), relu(+-a_i - 1), a_i = w_i . (x - x_silence): distance from silence
    variation: slice  # the rest: token choice inside a group, label context, repeat suppression
    group_of: torch.Tensor  # [V] each label's group
    follower_of: torch.Tensor  # [G] the group that tends to follow group j in the same frame, or -1

    @property
    def num_groups(self) -> int:
        return self.evidence.stop - self.evidence.start

    @staticmethod
    def make(hidden: int, pred_hidden: int, vocab: int, recipe, gen) -> "_JointLayout":
        num_dirs = max(2, hidden // 40)
        groups = round(vocab / recipe.tokens_per_group)
        groups = int(min(max(4, groups), (hidden - 4 * num_dirs) // 7, pred_hidden // 3))
        cut = np.cumsum([groups] * 5 + [4 * num_dirs])
        spans = [slice(0, cut[0])] + [slice(cut[i], cut[i + 1]) for i in range(5)] + [slice(cut[5], hidden)]
        group_of = torch.randperm(vocab, generator=gen) % groups  # balanced
        # Heads (a `follow_fraction` of the groups) each get a follower among the other groups, which
        # have none: chains stay at two labels, which the two-label memory still covers.
        order = torch.randperm(groups, generator=gen)
        num_heads = int(round(recipe.follow_fraction * groups))
        heads, tails = order[:num_heads], order[num_heads:]
        follower_of = torch.full((groups,), -1)
        if len(tails):
            follower_of[heads] = tails[torch.randint(len(tails), (num_heads,), generator=gen)]
        return _JointLayout(*spans, group_of=group_of, follower_of=follower_of)


def _shape_weights(model, recipe: _RandomInitRecipe, gen: torch.Generator, timings: dict) -> None:
    _randomise_encoder_norms(model.encoder, recipe, gen)
    joint = model.joint
    layout = _JointLayout.make(
        joint.enc.weight.shape[0], joint.pred.weight.shape[1], joint.num_classes_with_blank - 1, recipe, gen
    )
    register_levels = _shape_predictor(model.decoder, layout, recipe, gen)
    with _phase(timings, "encode"):
        encoded, quiet, probes = _calibration_encoder_outputs(model, recipe)
    frames, silences = encoded, [quiet]  # [T, D] each, as the joint sees them
    if getattr(model, "concat", False):
        _shape_prompt_kernel(model.prompt_kernel, model.num_prompts, encoded, recipe, gen)
        frames, silences = _apply_prompts(model, encoded, quiet)
        probes = [_apply_prompt(model, p, 0) for p in probes]
    with _phase(timings, "joint"):
        _shape_joint(model, layout, register_levels, frames, silences, probes, recipe, gen)
    if hasattr(model, "ctc_decoder"):
        _shape_ctc(model, frames, recipe, gen)
    model.encoder.set_default_att_context_size(list(model.encoder.att_context_size_all[0]))


def _randomise_encoder_norms(encoder, recipe, gen) -> None:
    """Non-trivial LayerNorm gains/biases and pos_bias_u/v: a runtime that drops one of them must not match."""
    for module in encoder.modules():
        if isinstance(module, torch.nn.LayerNorm) and module.elementwise_affine:
            module.weight.copy_(torch.exp(recipe.layer_norm_gain_std * _randn(gen, module.weight.shape)))
            module.bias.copy_(recipe.layer_norm_bias_std * _randn(gen, module.bias.shape))
        for attr in ("pos_bias_u", "pos_bias_v"):
            param = module._parameters.get(attr)
            if param is not None:
                param.copy_(recipe.pos_bias_std * _randn(gen, param.shape))


def _shape_prompt_kernel(prompt_kernel, num_prompts: int, encoded, recipe, gen) -> None:
    """Make the language one-hot move prompt_kernel's hidden units by `prompt_scale` times the
    spread the encoder output gives them: enough to change tokens, not the emission rate."""
    first = prompt_kernel[0]  # Linear(D + P, 2D); the one-hot is concatenated after the encoder output
    spread = (torch.cat(encoded) @ first.weight[:, :-num_prompts].T).std(0)  # [2D]
    offsets = recipe.prompt_scale * spread[:, None] * _randn(gen, (first.weight.shape[0], num_prompts))
    first.weight[:, -num_prompts:] = offsets


def _shape_predictor(decoder, layout: _JointLayout, recipe, gen) -> tuple[float, float]:
    """Give the LSTM two one-hot registers of token groups; return their "on" levels in the output.

    Hidden units [0, G) of every layer hold the group of the last label ("last"), units
    [G, 2G) the group of the label before ("prev", copied from "last" through the recurrent
    weights): on (a fixed level) or off (0), so the joint can gate on them sharply. This
    is state a runtime must carry exactly (h and c). The embedding of label k is random
    plus its group's prototype, orthogonal to the random part. The other units keep NeMo's
    random weights, with a short memory (forget gate mostly closed).
    """
    lstm = decoder.prediction["dec_rnn"].lstm
    embed = decoder.prediction["embed"].weight  # [V + 1, Hp]; row V (blank) is the zero SOS/pad row
    hidden, groups = lstm.hidden_size, layout.num_groups
    vocab = len(layout.group_of)
    protos = torch.linalg.qr(_randn(gen, (hidden, groups)))[0].T  # [G, Hp], orthonormal rows
    rand = embed[:vocab] - (embed[:vocab] @ protos.T) @ protos
    embed[:vocab] = rand + 4.0 * protos[layout.group_of]
    last, prev, registers = slice(0, groups), slice(groups, 2 * groups), slice(0, 2 * groups)
    eye = torch.eye(hidden)
    for layer in range(lstm.num_layers):
        w_ih, w_hh = getattr(lstm, f"weight_ih_l{layer}"), getattr(lstm, f"weight_hh_l{layer}")
        b_ih, b_hh = getattr(lstm, f"bias_ih_l{layer}"), getattr(lstm, f"bias_hh_l{layer}")
        b_hh.zero_()
        b_ih.copy_(0.1 * _randn(gen, b_ih.shape))  # gate blocks: input, forget, cell, output
        b_ih[0:hidden] += 1.0
        b_ih[hidden : 2 * hidden] += recipe.lstm_forget_bias
        b_ih[3 * hidden : 4 * hidden] += 1.0

        def rows(gate: int, units: slice) -> slice:
            return slice(gate * hidden + units.start, gate * hidden + units.stop)

        for gate in range(4):
            w_ih[rows(gate, registers)], w_hh[rows(gate, registers)] = 0.0, 0.0
        b_ih[rows(0, registers)], b_ih[rows(1, registers)], b_ih[rows(3, registers)] = 4.0, -8.0, 4.0
        b_ih[rows(2, registers)] = 0.0
        if layer == 0:
            w_ih[rows(2, last)] = protos  # reads the group prototype of the embedding: tanh(4) or 0
            w_hh[rows(2, prev)] = 6.0 * eye[last]  # the "last" register of the step before
        else:
            w_ih[rows(2, registers)] = 6.0 * eye[registers]  # upper layers copy the registers
    a, b = (int((layout.group_of == j).nonzero()[0]) for j in range(2))
    g, _ = decoder.predict(torch.tensor([[a, b]]), None, add_sos=False, batch_size=1)
    return float(g[0, 1, 1]), float(g[0, 1, groups])  # group 1 is last, group 0 is prev


def _calibration_encoder_outputs(model, recipe) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """Encoder outputs [T, D] on generated audio: `calibration_utterances` utterances of 8 s
    (longer than any left context) dealt round-robin over the trained context modes; 4 s of
    near-silence in the default mode; and one 4 s probe utterance in every mode (how the
    mode alone moves the output)."""
    modes = model.encoder.att_context_size_all
    quiet = np.random.default_rng(_CALIBRATION_AUDIO_SEED - 1).normal(0, 1e-4, 4 * SAMPLE_RATE)
    probe = synth_audio(4.0, _CALIBRATION_AUDIO_SEED - 2)
    encoded, probes, silence = [], [], None
    for mode_idx, mode in enumerate(modes):
        seeds = range(mode_idx, recipe.calibration_utterances, len(modes))
        if len(seeds):
            encoded += _encode(model, mode, torch.stack([synth_audio(8.0, _CALIBRATION_AUDIO_SEED + s) for s in seeds]))
        short = [probe] + ([torch.from_numpy(quiet).float()] if mode_idx == 0 else [])
        out = _encode(model, mode, torch.stack(short))
        probes.append(out[0])
        silence = out[1] if mode_idx == 0 else silence
    return encoded, silence, probes


def _encode(model, mode, audio: torch.Tensor) -> list[torch.Tensor]:
    """[B, T] equal-length audio -> B encoder outputs [T', D], offline, in the given context mode."""
    model.encoder.set_default_att_context_size(list(mode))
    feats, feat_len = model.preprocessor(input_signal=audio, length=torch.full((len(audio),), audio.shape[1]))
    out, out_len = model.encoder(audio_signal=feats, length=feat_len)
    return [out[i, :, : out_len[i]].T for i in range(len(audio))]


def _apply_prompts(model, encoded, quiet) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prompt model: one language per sequence, round-robin over the prompt dictionary;
    the silence goes through every language."""
    langs = list(model.cfg.model_defaults.prompt_dictionary.values())
    frames = [_apply_prompt(model, x, langs[i % len(langs)]) for i, x in enumerate(encoded)]
    silences = [_apply_prompt(model, quiet, lang) for lang in langs]
    return frames, silences


def _apply_prompt(model, encoded: torch.Tensor, lang: Optional[int]) -> torch.Tensor:
    """[T, D] encoder output -> [T, D] joint input (through prompt_kernel for a prompt model)."""
    if lang is None:
        return encoded
    one_hot = torch.zeros(encoded.shape[0], model.num_prompts)
    one_hot[:, lang] = 1.0
    return model.prompt_kernel(torch.cat([encoded, one_hot], dim=-1))


def _shape_joint(model, lay: _JointLayout, register_levels, frames, silences, probes, recipe, gen) -> None:
    """Rebuild the joint so that greedy decoding behaves roughly like a trained model's.

    Token groups stand in for acoustic content. A frame carries evidence e_j(t) for each
    group j; token k's logit is group_scale * relu(e_group(k)(t)), minus a large penalty
    while its group is one of the last two labels', plus a smaller term that depends on the
    frame and the label context (and pushes down the label just emitted), plus a boost
    right after a label of the group it follows, if any. The blank logit gets back the
    evidence of the last two labels' groups through gate units the predictor registers
    open, a bonus near silence, and a calibrated bias. So a frame emits when its content
    (best group) changes to one not just emitted, about once per change (twice when a
    follower comes along), and silence emits nothing.
    """
    joint = model.joint
    x = torch.cat(frames).double()  # [N, D]
    w_enc, b_enc = _joint_encoder_side(x, silences, probes, lay, gen)
    h = _predictor_outputs(model.decoder, len(lay.group_of), gen)  # [V, Hp]
    w_pred, b_pred, readout = _joint_predictor_side(h, lay, register_levels, recipe, gen)
    w_out, b_out = _joint_output_layer(x, h, (w_enc, b_enc), (w_pred, b_pred), readout, lay, recipe, gen)
    unk = _unk_id(model)
    if unk is not None:
        w_out[unk], b_out[unk] = 0.0, _UNK_LOGIT
    layers = ((joint.enc, w_enc, b_enc), (joint.pred, w_pred, b_pred), (joint.joint_net[-1], w_out, b_out))
    for layer, weight, bias in layers:
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    _fit_blank_and_followers(model, lay, [joint.project_encoder(f) for f in frames], recipe)


def _joint_encoder_side(x, silences, probes, lay: _JointLayout, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """joint.enc for frames x [N, D]: evidence (also feeding both gate sets), silence distance, variation."""
    mu, sigma = x.mean(0), x.std(0) + 1e-6
    # Moves, in whitened space, that are not content: how silence moves with the language (prompt
    # models) and over the first and last frames of an utterance, and how the context mode moves
    # the same audio. Every frame direction below is orthogonal to the main ones, so that silence
    # reads as silence wherever it is and the emission rate hardly depends on the mode.
    quiet = torch.stack([q.double() for q in silences])  # [languages, T, D]
    silence = quiet.mean((0, 1))
    silence_moves = torch.cat([quiet.mean(1) - silence, quiet[0] - quiet[0].mean(0)]) / sigma
    probe = torch.stack([p.double() for p in probes])  # [modes, T, D]: the same audio in every mode
    mode_moves = (probe - probe.mean(0)).mean(1) / sigma
    moves = torch.cat([_main_directions(m, x.shape[1] // 8) for m in (silence_moves, mode_moves)])
    moves = torch.linalg.qr(moves.T)[0].T  # orthonormal rows

    def frame_directions(rows: int, centre: torch.Tensor, rms: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Random encoder directions (weight, bias) whose outputs have unit std (or RMS) over the frames."""
        w = _randn64(gen, (rows, x.shape[1]))
        w = (w - (w @ moves.T) @ moves) / sigma
        y = (x - centre) @ w.T
        w /= (y.pow(2).mean(0) if rms else y.var(0)).sqrt()[:, None]
        return w, -(w @ centre)

    hidden = lay.variation.stop
    w_enc = torch.zeros(hidden, x.shape[1], dtype=torch.float64)
    b_enc = torch.zeros(hidden, dtype=torch.float64)
    w_ev, b_ev = frame_directions(lay.num_groups, mu, rms=False)
    for units in (lay.evidence, lay.gate_last, lay.gate_prev):
        w_enc[units], b_enc[units] = w_ev, b_ev
    # Distance from silence: a_i = w_i . (x - silence), clamped to [0, 1] per direction.
    w_sil, b_sil = frame_directions((lay.silence.stop - lay.silence.start) // 4, silence, rms=True)
    w_enc[lay.silence] = torch.cat([w_sil, -w_sil, w_sil, -w_sil])
    b_enc[lay.silence] = torch.cat([b_sil, -b_sil, b_sil - 1.0, -b_sil - 1.0])
    w_enc[lay.variation], b_enc[lay.variation] = frame_directions(hidden - lay.variation.start, mu, rms=False)
    return w_enc, b_enc


def _predictor_outputs(decoder, vocab: int, gen) -> torch.Tensor:
    """[V, Hp] predictor output after each label, averaged over an empty and a random one-label history."""
    labels = torch.arange(vocab)
    g_first, _ = decoder.predict(labels[:, None], None, add_sos=False, batch_size=vocab)
    prev = torch.randint(vocab, (vocab,), generator=gen)
    g_second, _ = decoder.predict(torch.stack([prev, labels], 1), None, add_sos=False, batch_size=vocab)
    return (g_first[:, 0] + g_second[:, 1]).double() / 2


def _joint_predictor_side(h, lay: _JointLayout, register_levels, recipe, gen):
    """joint.pred: gates and flags read the predictor's group registers; the variation units get a
    random image of the label (-suppress times the one its tokens read, + pred_noise times another).
    Returns (weight, bias, readout [V, num_var] of each token on the variation units)."""
    hidden, groups = lay.variation.stop, lay.num_groups
    num_var = hidden - lay.variation.start

    def label_directions(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Random predictor directions (weight, bias) with zero-mean unit-std outputs over labels, and the outputs."""
        w = _randn64(gen, (rows, h.shape[1]))
        w /= (h @ w.T).std(0)[:, None]
        b = -(h @ w.T).mean(0)
        return w, b, h @ w.T + b

    eye = torch.eye(groups, dtype=torch.float64)
    w_pred = torch.zeros(hidden, h.shape[1], dtype=torch.float64)
    b_pred = torch.zeros(hidden, dtype=torch.float64)
    sharp = recipe.gate_sharpness
    for gates, register, level in zip((lay.gate_last, lay.gate_prev), (0, groups), register_levels):
        w_pred[gates, register : register + groups] = sharp / level * eye
        b_pred[gates] = -sharp  # off register: gate at e_j - K; on: at e_j
    w_pred[lay.last_flag, :groups] = eye / register_levels[0]  # 1 or 0
    w_pred[lay.prev_flag, groups : 2 * groups] = eye / register_levels[1]
    w_m, b_m, readout = label_directions(num_var)
    w_n, b_n, _ = label_directions(num_var)
    w_pred[lay.variation] = -recipe.suppress * w_m + recipe.pred_noise * w_n
    b_pred[lay.variation] = -recipe.suppress * b_m + recipe.pred_noise * b_n
    return w_pred, b_pred, readout


def _joint_output_layer(x, h, enc, pred, readout, lay: _JointLayout, recipe, gen):
    """The joint's output Linear (tokens, then the blank last), before the blank bias and followers."""
    vocab, hidden = len(lay.group_of), lay.variation.stop
    labels = torch.arange(vocab)
    w_out = torch.zeros(vocab + 1, hidden, dtype=torch.float64)
    b_out = torch.zeros(vocab + 1, dtype=torch.float64)
    w_out[labels, lay.evidence.start + lay.group_of] = recipe.group_scale
    # The groups of the last two labels are out whatever the blank does: no cycles, no stutter.
    w_out[labels, lay.last_flag.start + lay.group_of] = -recipe.repeat_penalty * recipe.group_scale
    w_out[labels, lay.prev_flag.start + lay.group_of] = -recipe.repeat_penalty * recipe.group_scale
    num_var = hidden - lay.variation.start
    w_out[:vocab, lay.variation] = recipe.variation_scale * readout / math.sqrt(num_var)
    enc_var = x @ enc[0][lay.variation].T + enc[1][lay.variation]
    pred_var = h @ pred[0][lay.variation].T + pred[1][lay.variation]
    pairs = torch.randint(len(x), (8192,), generator=gen), torch.randint(vocab, (8192,), generator=gen)
    mean_act = torch.relu(enc_var[pairs[0]] + pred_var[pairs[1]]).mean(0)
    b_out[:vocab] = -(w_out[:vocab, lay.variation] @ mean_act)  # no token is preferred whatever the frame
    gate = recipe.gate_scale * recipe.group_scale
    w_out[vocab, lay.gate_last], w_out[vocab, lay.gate_prev] = gate, gate
    num_dirs = (lay.silence.stop - lay.silence.start) // 4
    clamp = torch.tensor([-1.0, -1.0, 1.0, 1.0], dtype=torch.float64).repeat_interleave(num_dirs)
    w_out[vocab, lay.silence] = recipe.silence_weight / num_dirs * clamp  # -weight * mean(min(|a_i|, 1))
    return w_out, b_out


def _fit_blank_and_followers(model, lay: _JointLayout, projected, recipe) -> None:
    """Set the follower boosts and the blank bias on the joint-projected calibration frames."""
    out, blank = model.joint.joint_net[-1], len(lay.group_of)
    # A rough bias from every other sequence first (it only sets the follower boost), then the fit.
    blank_bias = _calibrate_blank(model, projected[::2], recipe.target_emitting_frames, -20.0, 40.0, rounds=2)
    # Followers: after a label of group j, group follower_of[j] gets the blank bias + a margin, so it
    # usually comes out in the same frame (frames with 2-3 tokens); then the blank bias is re-fitted.
    boost = blank_bias + recipe.follow_margin * recipe.group_scale
    for group, follower in enumerate(lay.follower_of.tolist()):
        if follower >= 0:
            followers = (lay.group_of == follower).nonzero()[:, 0]
            out.weight[followers, lay.last_flag.start + group] = boost
    out.bias[blank] = _calibrate_blank(
        model, projected, recipe.target_emitting_frames, blank_bias - 2.0, blank_bias + 8.0, rounds=2
    )


def _main_directions(vectors: torch.Tensor, max_count: int) -> torch.Tensor:
    """Orthonormal rows spanning the strong part (singular values over 5% of the largest) of `vectors`."""
    _, strength, directions = torch.linalg.svd(vectors, full_matrices=False)
    return directions[strength > 0.05 * strength[0]][:max_count]


def _unk_id(model) -> Optional[int]:
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        return None
    unk = tokenizer.tokenizer.unk_id()
    return unk if unk >= 0 else None


def _calibrate_blank(model, projected: list[torch.Tensor], target: float, lo: float, hi: float, rounds: int) -> float:
    """Blank bias giving `target` emitting frames on the calibration frames: grid bisection.

    Each round decodes all frames for 8 candidate biases at once (one batch) and keeps the
    bracket around the target (moving it if the target lies outside); a round narrows it 7 times.
    """
    for _ in range(rounds):
        candidates = torch.linspace(lo, hi, 8, dtype=torch.float64)
        fractions = simulate_greedy(model, projected, candidates.float()).emitting_fraction
        above = (fractions >= target).nonzero()  # the fraction falls as the blank bias rises
        if len(above) == 0:
            lo, hi = lo - (hi - lo), lo
        elif int(above[-1]) == len(candidates) - 1:
            lo, hi = hi, hi + (hi - lo)
        else:
            i = int(above[-1])
            lo, hi = float(candidates[i]), float(candidates[i + 1])
    return round((lo + hi) / 2, 3)


@dataclass
class GreedyStats:
    """Per-candidate statistics of a greedy RNN-T decode: all tensors [C]."""

    emitting_fraction: torch.Tensor  # frames with >= 1 token / frames
    tokens_per_frame: torch.Tensor
    max_symbols_fraction: torch.Tensor  # frames cut off at max_symbols / frames
    distinct_tokens: torch.Tensor


@torch.no_grad()
def simulate_greedy(model, projected: Sequence[torch.Tensor], blank_offsets: torch.Tensor) -> GreedyStats:
    """Greedy RNN-T decoding (NeMo's rule: emit while non-blank, at most max_symbols per frame)
    of every sequence of joint-projected frames [T, H] for every blank offset [C] at once.

    A stand-in for NeMo's label-looping decoder in calibration, where it runs for many
    candidate blank biases in one batch; the tests check the result with NeMo's own decoder.
    A row that emits over 1.5 tokens per frame is cut short and counted as all-emitting:
    it only tells the bisection that its bias is far too low.
    """
    joint, decoder = model.joint, model.decoder
    max_symbols = int(model.cfg.decoding.greedy.get("max_symbols", 10))
    out = joint.joint_net[-1]
    blank = joint.num_classes_with_blank - 1
    num_cands = len(blank_offsets)
    rows = len(projected) * num_cands
    seq_of_row = torch.arange(rows) // num_cands
    cand_of_row = torch.arange(rows) % num_cands
    lengths = torch.tensor([f.shape[0] for f in projected])[seq_of_row]
    frames = torch.nn.utils.rnn.pad_sequence(list(projected), batch_first=True)[seq_of_row]  # [R, T, H]
    offsets = blank_offsets[cand_of_row]

    g, (h, c) = decoder.predict(None, None, add_sos=False, batch_size=rows)  # h, c: [L, R, Hp]
    pred = joint.project_prednet(g)[:, 0]  # [R, H]
    t = torch.zeros(rows, dtype=torch.long)
    symbols = torch.zeros(rows, dtype=torch.long)
    emitted_here = torch.zeros(rows, dtype=torch.bool)
    num_emitting, num_tokens, num_cut = torch.zeros(rows), torch.zeros(rows), torch.zeros(rows)
    seen = torch.zeros(num_cands, blank + 1, dtype=torch.bool)
    live = torch.arange(rows)  # rows with frames left
    while len(live):
        logits = out(torch.relu(frames[live, t[live]] + pred[live]))
        logits[:, blank] += offsets[live]
        label = logits.argmax(-1)
        emit = label != blank
        rows_emit = live[emit]
        if len(rows_emit):
            num_tokens[rows_emit] += 1
            emitted_here[rows_emit] = True
            seen[cand_of_row[rows_emit], label[emit]] = True
            g, (h_new, c_new) = decoder.predict(label[emit, None], (h[:, rows_emit], c[:, rows_emit]), add_sos=False)
            pred[rows_emit] = joint.project_prednet(g)[:, 0]
            h[:, rows_emit], c[:, rows_emit] = h_new, c_new
            symbols[rows_emit] += 1
        advance = ~emit | (symbols[live] >= max_symbols)
        num_cut[live[advance & emit]] += 1
        rows_adv = live[advance]
        num_emitting[rows_adv] += emitted_here[rows_adv].float()
        emitted_here[rows_adv], symbols[rows_adv] = False, 0
        t[rows_adv] += 1
        runaway = live[num_tokens[live] > 1.5 * t[live] + 5]
        num_emitting[runaway] += (lengths[runaway] - t[runaway]).float()
        t[runaway] = lengths[runaway]
        live = live[t[live] < lengths[live]]

    def per_cand(x):
        return torch.zeros(num_cands).index_add_(0, cand_of_row, x)

    total_frames = per_cand(lengths.float())
    return GreedyStats(
        emitting_fraction=per_cand(num_emitting) / total_frames,
        tokens_per_frame=per_cand(num_tokens) / total_frames,
        max_symbols_fraction=per_cand(num_cut) / total_frames,
        distinct_tokens=seen.sum(1),
    )


def _shape_ctc(model, frames, recipe, gen) -> None:
    """Hybrid models: whitened random CTC head, blank bias at the quantile giving the target rate."""
    conv = model.ctc_decoder.decoder_layers[0]  # Conv1d(D, V + 1, 1)
    x = torch.cat(frames).double()
    mu, sigma = x.mean(0), x.std(0) + 1e-6
    num_classes = conv.weight.shape[0]
    blank = num_classes - 1
    w = _randn64(gen, (num_classes, x.shape[1])) / sigma
    w *= recipe.group_scale / ((x - mu) @ w.T).std(0)[:, None]
    b = -(w @ mu)
    w[blank], b[blank] = 0.0, 0.0
    unk = _unk_id(model)
    if unk is not None:
        w[unk], b[unk] = 0.0, _UNK_LOGIT
    logits = x @ w.T + b
    best_token = logits[:, :blank].max(-1).values
    b[blank] = torch.quantile(best_token, 1.0 - recipe.target_emitting_frames)
    conv.weight.copy_(w[:, :, None])
    conv.bias.copy_(b)


# --------------------------------------------------------------------------- helpers


def _randn(gen: torch.Generator, shape) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=gen)


def _randn64(gen: torch.Generator, shape) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64)


def _derived_seed(name: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{name}:{seed}".encode()).digest()[:4], "little") & 0x7FFFFFFF


def _import_class(path: str):
    module, _, cls = path.rpartition(".")
    return getattr(importlib.import_module(module), cls)


@contextlib.contextmanager
def _phase(timings: dict, name: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = time.perf_counter() - start


@contextlib.contextmanager
def _torch_threads(num: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@contextlib.contextmanager
def _quiet_nemo():
    from nemo.utils import logging as nemo_logging

    with nemo_logging.temp_verbosity(nemo_logging.ERROR):
        yield


@contextlib.contextmanager
def _quiet_fds():
    """Silence C++ stderr chatter (SentencePiece's trainer) for the block."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# --------------------------------------------------------------------------- measuring


@torch.no_grad()
def decode_offline(model, audio: torch.Tensor, att_context_size: Sequence[int], lang: Optional[str] = None):
    """NeMo's own offline chunked-limited forward + greedy decoding of a batch [B, T] of equal-length audio.

    Returns (hypotheses, encoded_len). For a prompt model, `lang` is a prompt_dictionary key.
    """
    model.encoder.set_default_att_context_size(list(att_context_size))
    lengths = torch.full((audio.shape[0],), audio.shape[1])
    kwargs = {}
    if getattr(model, "concat", False):
        prompts = model.cfg.model_defaults.prompt_dictionary
        index = prompts[lang or next(iter(prompts))]
        kwargs["prompt_indices"] = torch.full((audio.shape[0],), index, dtype=torch.long)
    encoded, encoded_len = model.forward(input_signal=audio, input_signal_length=lengths, **kwargs)
    hyps = model.decoding.rnnt_decoder_predictions_tensor(
        encoder_output=encoded, encoded_lengths=encoded_len, return_hypotheses=True
    )
    return hyps, encoded_len


def emission_stats(hyps, encoded_len) -> dict:
    """Tokens per frame, fraction of frames emitting, distinct tokens, frames cut at max_symbols."""
    frames = int(encoded_len.sum())
    tokens, emitting, distinct = 0, 0, set()
    for hyp in hyps:
        ids = [int(i) for i in hyp.y_sequence]
        stamps = hyp.timestamp["timestep"] if isinstance(hyp.timestamp, dict) else hyp.timestamp
        stamps = [int(s) for s in stamps]
        tokens += len(ids)
        emitting += len(set(stamps))
        distinct.update(ids)
    return {
        "frames": frames,
        "tokens_per_frame": tokens / frames,
        "emitting_fraction": emitting / frames,
        "distinct_tokens": len(distinct),
    }


def _main(argv: Optional[Sequence[str]] = None) -> None:
    """`python -m nemo_serve.builtin [NAME ...] [--seed N]`: build, then print what the module
    docstring reports (parameters, build time, emission per mode and language) as JSON lines."""
    import argparse

    parser = argparse.ArgumentParser(description=_main.__doc__)
    parser.add_argument("names", nargs="*", default=list(BUILTIN_NAMES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--utterances", type=int, default=3, help="8 s synthetic test utterances per mode")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    audio = torch.stack([synth_audio(8.0, 1000 + i) for i in range(args.utterances)])
    for name in args.names:
        start = time.perf_counter()
        model = build_builtin(name, args.seed)
        row = {
            "name": name,
            "parameters": sum(p.numel() for p in model.parameters()),
            "build_s": round(time.perf_counter() - start, 1),
            "modes": {},
        }
        langs = list(model.cfg.model_defaults.prompt_dictionary)[:3] if getattr(model, "concat", False) else [None]
        for mode in model.encoder.att_context_size_all:
            for lang in langs:
                stats = emission_stats(*decode_offline(model, audio, mode, lang))
                key = f"{list(mode)}" + (f" {lang}" if lang else "")
                row["modes"][key] = {k: round(v, 3) if isinstance(v, float) else v for k, v in stats.items()}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    _main()

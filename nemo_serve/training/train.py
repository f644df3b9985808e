"""Train the embedded demo model (cache-aware streaming FastConformer, hybrid RNN-T + CTC, BPE 128).

Reproducible command (all defaults; seeds fixed with ``--seed 1234``)::

    python -m nemo_serve.training.corpus --out work_data/corpus --n-train 24000      # ~4 min, 17.5 h of audio
    OMP_WAIT_POLICY=PASSIVE nice -n 5 python -m nemo_serve.training.train \
        --data work_data/corpus --out work_data/run3 [--resume]
    # shipped model: the above stopped at step 1350, then `--resume --steps 1900 --eval-every 100`, then
    # `--resume --steps 2700 --eval-every 100` (second cosine cycle), then
    # `--resume --steps 6000 --eval-every 200` (third cycle, 43 min), then a fourth cycle
    # `--resume --steps 10500 --eval-every 250` stopped at step 7700 and finished as `--resume --steps 9600
    # --eval-every 250` (62 min), then a fifth `--resume --steps 11800 --eval-every 250` (35 min), then a sixth
    # with chained items `--resume --steps 14800 --eval-every 250 --chain-prob 0.5 --chain-max 3 --dev-chain 4`
    # (42 min); shipped = step 14800
    python -m nemo_serve.training.ship --model work_data/run3/best.nemo --data work_data/corpus

Since issue 18 the shipped model is that step-14800 model fine-tuned on a corpus with flite voices (four of
flite's five voices, varied; rms held out), with SpecAugment from the first step (docs/demo_model.md has the
commands as run and the measured time)::

    python -m nemo_serve.training.corpus --out work_data/corpus --n-train 24000 --n-train-flite 12000
    OMP_WAIT_POLICY=PASSIVE nice -n 19 python -m nemo_serve.training.train --data work_data/corpus \
        --out work_data/ft1 --init work_data/demo_step14800.nemo --dev-manifest dev_mix.jsonl \
        --steps 3600 --lr 5e-4 --warmup 100 --ctc-warmup 0 --short-steps 0 --specaug-start 0 \
        --chain-prob 0.5 --chain-max 3 --dev-chain 4 --eval-every 200

Recipe (configs/demo_model.yaml):

* Data: espeak-ng (+ flite) corpus from ``nemo_serve.training.corpus``, held in RAM as int16; features come from the
  model's own preprocessor (80 log-mels, normalize NA, pad_to 0, dither 1e-5 in training only).
* Tokenizer: 128-piece SentencePiece BPE over the training sentences, made with NeMo's
  ``create_spt_model(..., tokenizer_type="bpe")`` (tokenizer.model, tokenizer.vocab, vocab.txt in
  configs/demo_tokenizer); the ``.nemo`` embeds it.
* Model: ``EncDecHybridRNNTCTCBPEModel``: 4 x d128 FastConformer, 4 heads, causal dw_striding x8 (96 ch),
  causal depthwise convs (kernel 9), chunked_limited attention, att_context_size
  [[56,13],[56,6],[56,3],[56,0]] (NeMo samples one mode per batch in training mode, so every lookahead is
  trained), RNN-T head (pred LSTM / joint 192) + CTC head. 2.18M parameters.
* Init: the first subsampling conv is initialised to see standardised log-mels (``center_input_conv``).
* Loss: CTC only for the first ``--ctc-warmup`` (600) steps, then ``0.7*RNNT + 0.3*CTC``.  The RNN-T loss
  is a vectorised PyTorch implementation (``rnnt_loss``), numerically equal to NeMo's warprnnt_numba loss
  (tested) and ~10x faster on CPU.
* Batches: duration-bucketed, ``--batch-seconds`` (40) of padded audio per batch; curriculum: only
  utterances <= 2.0 s during the CTC warm-up.  Long streams: with ``--chain-prob p`` a share p of the items
  are 2..``--chain-max`` utterances joined by short pauses (the sixth cycle; without it the model dropped
  the first words of every later sentence in a stream).
* Optimiser: AdamW (betas 0.9/0.98, wd 1e-3), linear warm-up to 1.5e-3 over 200 steps, cosine decay towards
  5% of peak at ``--steps`` (4000); grad-norm clip 1.0.  SpecAugment (``--specaug-start``; 2 freq masks of
  up to 12 bins, 2 time masks of up to 5%, masked with -11, the log-mel mean) was off in the six espeak-ng
  cycles and is on from the first step of the flite fine-tune.
* Random channels (``--channel-eq-db``, from the third flite fine-tune on): each item's mel power goes through
  a random smooth EQ (``random_eq``), so a voice recorded through another microphone is not a new voice.
* Pseudo-speakers (``--vtlp``, tried in the fifth flite fine-tune): each item's mel power is warped in
  frequency by a random factor (``random_vtlp``), moving its formants as a longer or shorter vocal tract would.
* Fine-tuning: ``--init FILE.nemo`` starts from a trained model's weights with a fresh optimiser and step 0;
  with ``--encoder-layers N`` deeper than the file's, its layers are stacked into the deeper encoder.
* Checkpoints: ``OUT/last.pt`` (model + optimiser, every 50 steps; ``--resume`` continues from it),
  ``OUT/best.nemo`` (best dev WER, greedy RNN-T at the default [56,13] mode, full-utterance forward with the
  chunked_limited mask), ``OUT/log.jsonl`` (loss / WER curve); with ``--keep-every N`` also the weights of
  every Nth step, ``OUT/step_NNNNNN.pt``, for checkpoint averaging (``average.py``).

Why (measured, see docs/demo_model.md): with the RNN-T loss on from step 0 the prediction network learns the
sentence templates while the encoder output collapses to an input-independent vector; CTC per-token loss sat at
~4.4 nats (= token prior) for 450+ steps.  CTC-only warm-up on short utterances forces the encoder to use the
audio: CTC loss leaves the prior after ~300 steps and the dev WER falls from step ~600.
Measured training time: 14,800 steps in 266 min wall on 2 CPU cores, mostly shared with other jobs
(0.6-3.4 s/step); dev WER (greedy RNN-T, offline, 100 utterances) 100% @600, 78% @800, 54% @1000, 42% @1200,
29% @1400, 25.4% @1800, 21.8% @2700, 17.8% @4000, 13.5% @4800, 12.6% @6000, 10.3% @9600, 9.5% @11800,
9.5% @14800 (shipped; chained by four 8.3%).
Streaming WERs per held-out set and mode: docs/demo_model.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import torch

from ..audio_io import load_manifest
from ..config_files import config_dir
from ..nemo_private import preprocessor_sample_rate
from ..scoring import word_errors
from .eou import EOU_PIECE, grow_state, strip_eou

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


def load_audio(manifest: Path, limit: int | None = None) -> tuple[list[np.ndarray], list[str]]:
    """int16 audio (held in RAM for the whole run: half of float32) and texts of a manifest's first `limit` rows."""
    rows = load_manifest(manifest, dtype="int16", limit=limit)
    return [audio for _, audio in rows], [row["text"] for row, _ in rows]


def collate(wavs: list[np.ndarray], token_lists: list[list[int]]):
    B = len(wavs)
    T = max(len(w) for w in wavs)
    U = max(max(len(t) for t in token_lists), 1)
    sig = torch.zeros(B, T)
    lab = torch.zeros(B, U, dtype=torch.long)
    for i, (w, t) in enumerate(zip(wavs, token_lists)):
        sig[i, : len(w)] = torch.from_numpy(w.astype(np.float32) / 32768.0)
        lab[i, : len(t)] = torch.tensor(t, dtype=torch.long)
    sig_len = torch.tensor([len(w) for w in wavs], dtype=torch.long)
    lab_len = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    return sig, sig_len, lab, lab_len


def make_batches(durs: np.ndarray, idx: np.ndarray, batch_seconds: float, rng: np.random.Generator,
                 max_batch: int = 64) -> list[list[int]]:
    """Duration-bucketed batches: shuffle, sort within pools of 2000, cut by total padded seconds."""
    idx = idx.copy()
    rng.shuffle(idx)
    batches = []
    for p in range(0, len(idx), 2000):
        pool = sorted(idx[p: p + 2000], key=lambda i: durs[i])
        cur, cur_max = [], 0.0
        for i in pool:
            m = max(cur_max, durs[i])
            if cur and (m * (len(cur) + 1) > batch_seconds or len(cur) >= max_batch):
                batches.append(cur)
                cur, m = [], durs[i]
            cur.append(int(i))
            cur_max = m
        if cur:
            batches.append(cur)
    order = rng.permutation(len(batches))
    return [batches[i] for i in order]


def make_chains(idx: np.ndarray, rng: np.random.Generator, prob: float, max_len: int) -> list[tuple[int, ...]]:
    """Training items for one epoch: each utterance once, in random order; with probability ``prob`` an item
    is 2..max_len consecutive (shuffled) utterances streamed as one.  A live stream runs many sentences
    through one encoder cache and one prediction-network state; a model that only ever saw single sentences
    drops the first words of every later one (docs/demo_model.md, "Long streams").  With ``prob`` 0 the
    items are the utterances in pool order and no random number is drawn, so older recipes batch as before."""
    if prob <= 0 or max_len < 2:
        return [(int(i),) for i in idx]
    idx = idx.copy()
    rng.shuffle(idx)
    items, i = [], 0
    while i < len(idx):
        k = int(rng.integers(2, max_len + 1)) if rng.random() < prob else 1
        items.append(tuple(int(j) for j in idx[i: i + k]))
        i += k
    return items


def join_chain(wavs: list[np.ndarray], item: tuple[int, ...], rng: np.random.Generator,
               pause_s: tuple[float, float] = (0.0, 0.6)) -> np.ndarray:
    """The utterances of one item with a random pause (near-silent noise) between each pair."""
    if len(item) == 1:
        return wavs[item[0]]
    parts = []
    for n, i in enumerate(item):
        if n:
            gap = int(rng.uniform(*pause_s) * 16000)
            parts.append((rng.standard_normal(gap) * 3).astype(np.int16))
        parts.append(wavs[i])
    return np.concatenate(parts)


def chain_dev(wavs: list[np.ndarray], texts: list[str], k: int, pause_s: float = 0.3):
    """Utterances joined k at a time with pause_s of silence, texts joined (dev here, ``evaluate --chain``)."""
    if k <= 1:
        return [], []
    pause = np.zeros(int(pause_s * 16000), dtype=wavs[0].dtype if wavs else np.int16)
    out_w, out_t = [], []
    for i in range(0, len(wavs), k):
        out_w.append(np.concatenate([x for w in wavs[i: i + k] for x in (w, pause)][:-1]))
        out_t.append(" ".join(texts[i: i + k]))
    return out_w, out_t


# AudioToMelSpectrogramPreprocessor's default log_zero_guard_value (log_zero_guard_type "add")
LOG_GUARD = 2.0 ** -24


def random_eq(feats: torch.Tensor, lens: torch.Tensor, rng: np.random.Generator, max_db: float,
              points: int = 6, prob: float = 0.8) -> torch.Tensor:
    """A random microphone and room per item: the mel power of a share ``prob`` of the items is multiplied
    by a smooth gain curve (``points`` control points evenly spread over the mel axis, each uniform in
    +-max_db, joined linearly, the curve's mean removed so the level is left to the corpus's gain).  It
    works on power, not on the log, so digital silence stays at the log floor, and frames past an item's
    length are left alone.  A voice recorded through another channel differs mostly this way: matching the
    held-out flite voice's mean log-mel to the training voices' alone took its offline WER from 38% to 26%
    (docs/demo_model.md)."""
    grid = np.linspace(0, points - 1, feats.shape[1])

    def channel(power: torch.Tensor) -> torch.Tensor:
        db = np.interp(grid, np.arange(points), rng.uniform(-max_db, max_db, points))
        return power * torch.from_numpy(10.0 ** ((db - db.mean()) / 10.0)).to(power.dtype)[:, None]

    return _on_power(feats, lens, rng, prob, channel)


def _on_power(feats: torch.Tensor, lens: torch.Tensor, rng: np.random.Generator, prob: float, transform) -> torch.Tensor:
    """Log-mels with `transform` ([bands, frames] mel power -> the same) applied to a share ``prob`` of the
    items, on power so digital silence stays at the log floor; frames past an item's length are left alone."""
    out = feats.clone()
    for i in range(feats.shape[0]):
        if rng.random() >= prob:
            continue
        n = int(lens[i])
        power = (feats[i, :, :n].exp() - LOG_GUARD).clamp_min(0.0)
        out[i, :, :n] = torch.log(transform(power) + LOG_GUARD)
    return out


def mel_centers_hz(preprocessor) -> np.ndarray:
    """Each mel filter's centre frequency (its weighted mean), from the preprocessor's own filterbank."""
    fb = preprocessor.featurizer.fb[0].detach().double().cpu().numpy()  # [n_mels, n_fft // 2 + 1]
    freqs = np.linspace(0.0, preprocessor_sample_rate(preprocessor) / 2, fb.shape[1])
    return (fb * freqs).sum(1) / fb.sum(1)


def random_vtlp(feats: torch.Tensor, lens: torch.Tensor, rng: np.random.Generator, max_warp: float,
                centers_hz: np.ndarray, prob: float = 0.8) -> torch.Tensor:
    """Vocal tract length perturbation on the features: for a share ``prob`` of the items, a factor a
    uniform in 1 +- max_warp moves every spectral feature from frequency f to a * f (formants up for
    a > 1, as a shorter vocal tract has them).  Output band i reads the input's mel power at
    centers_hz[i] / a, interpolated linearly between bands (the band edge repeats past either end).
    On power, not on the log, so digital silence stays at the log floor; frames past an item's length
    are left alone.  A pseudo-speaker per item from every voice, as flite's --flite-warp makes per
    utterance at synthesis, but for espeak-ng and festival too."""
    return _on_power(feats, lens, rng, prob,
                     lambda power: warp_bands(power, rng.uniform(1.0 - max_warp, 1.0 + max_warp), centers_hz))


def warp_bands(power: torch.Tensor, a: float, centers_hz: np.ndarray) -> torch.Tensor:
    """[bands, frames] mel power with every feature moved from frequency f to a * f (random_vtlp)."""
    bands = np.arange(len(centers_hz), dtype=np.float64)
    src = np.interp(centers_hz / a, centers_hz, bands)  # fractional input band per output band
    lo = np.floor(src).astype(np.int64)
    hi = np.minimum(lo + 1, len(bands) - 1)
    w = torch.from_numpy(src - lo).to(power.dtype)[:, None]
    return power[torch.from_numpy(lo)] * (1 - w) + power[torch.from_numpy(hi)] * w


def lr_at(step: int, peak: float, warmup: int, total: int, floor: float = 0.05) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def rnnt_loss(logits: torch.Tensor, targets: torch.Tensor, logit_lens: torch.Tensor, target_lens: torch.Tensor,
              blank: int) -> torch.Tensor:
    """Vectorised RNN-T negative log-likelihood, summed per utterance and averaged over the batch.

    Same value as NeMo's ``RNNTLoss`` (warprnnt_numba, reduction ``mean_batch``) but ~10x faster on CPU:
    the forward variable is computed one time step at a time, and the recursion along the label axis
    (alpha[t,u] = logaddexp(alpha[t-1,u] + blank[t-1,u], alpha[t,u-1] + emit[t,u-1])) is solved in closed form
    with a cumulative sum and ``logcumsumexp``.  Gradients come from autograd.
    logits: [B, T, U+1, V] joint output (pre-softmax); targets: [B, U].
    """
    lp = logits.float().log_softmax(-1)
    B, T, U1, _ = lp.shape
    blank_lp = lp[..., blank]                                                    # [B, T, U+1]
    tg = targets[:, : U1 - 1].long().clamp(min=0)
    emit_lp = lp[:, :, : U1 - 1, :].gather(-1, tg[:, None, :, None].expand(B, T, U1 - 1, 1)).squeeze(-1)  # [B,T,U]
    zeros = lp.new_zeros(B, T, 1)
    csum = torch.cat([zeros, emit_lp.cumsum(-1)], dim=-1)                        # [B, T, U+1]
    neg_inf = torch.finfo(lp.dtype).min / 4
    a = torch.full((B, U1), neg_inf, dtype=lp.dtype, device=lp.device)
    a[:, 0] = 0.0
    alphas = []
    for t in range(T):
        if t > 0:
            a = alphas[-1] + blank_lp[:, t - 1]
            a = torch.cat([a[:, :1], a[:, 1:]], dim=-1)
        c = csum[:, t]
        alpha_t = c + torch.logcumsumexp(a - c, dim=-1)
        alphas.append(alpha_t)
    alpha = torch.stack(alphas, dim=1)                                           # [B, T, U+1]
    bi = torch.arange(B, device=lp.device)
    tl, ul = logit_lens.long() - 1, target_lens.long()
    ll = alpha[bi, tl, ul] + blank_lp[bi, tl, ul]
    return -ll.mean()


def hyp_text(h) -> str:
    return strip_eou(h.text if hasattr(h, "text") else str(h))  # an EOU model's token is no word


@torch.no_grad()
def offline_wer(model, wavs, texts, batch_size: int = 32) -> tuple[float, float, list[tuple[str, str]]]:
    """Greedy RNN-T and CTC WER, full-utterance forward with the default chunked_limited mask."""
    was_training = model.training
    model.eval()
    e_r = e_c = n = 0
    samples = []
    for b in range(0, len(wavs), batch_size):
        w, t = wavs[b: b + batch_size], texts[b: b + batch_size]
        sig, sig_len, _, _ = collate(w, [[0]] * len(w))
        enc, enc_len = model.forward(input_signal=sig, input_signal_length=sig_len)
        hyps = model.decoding.rnnt_decoder_predictions_tensor(encoder_output=enc, encoded_lengths=enc_len)
        if isinstance(hyps, tuple):
            hyps = hyps[0]
        lp = model.ctc_decoder(encoder_output=enc)
        chyps = model.ctc_decoding.ctc_decoder_predictions_tensor(lp, decoder_lengths=enc_len)
        if isinstance(chyps, tuple):
            chyps = chyps[0]
        for ref, h, c in zip(t, hyps, chyps):
            er, nr = word_errors(ref, hyp_text(h))
            ec, _ = word_errors(ref, hyp_text(c))
            e_r, e_c, n = e_r + er, e_c + ec, n + nr
            if len(samples) < 3:
                samples.append((ref, hyp_text(h)))
    model.train(was_training)
    return e_r / max(n, 1), e_c / max(n, 1), samples


def train(args) -> dict:
    torch.set_num_threads(args.threads)
    seed_all(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data)
    tok_dir = Path(args.tokenizer_dir)
    if not (tok_dir / "tokenizer.model").exists():
        make_tokenizer(data / "train_text.txt", tok_dir, args.vocab_size)

    t0 = time.time()
    wavs, texts = load_audio(data / args.train_manifest, args.limit)
    if args.dev_limit:
        dev_wavs, dev_texts = load_audio(data / args.dev_manifest, args.dev_limit)
    else:
        dev_wavs, dev_texts = [], []
    print(f"loaded {len(wavs)} train / {len(dev_wavs)} dev utterances in {time.time() - t0:.1f}s", flush=True)
    chain_wavs, chain_texts = chain_dev(dev_wavs, dev_texts, args.dev_chain)

    layers = args.encoder_layers or (init_depth(args.init) if args.init else None)
    model = build_model(Path(args.config), tok_dir, layers)
    if args.init and not (args.resume and (out / "last.pt").exists()):
        init_from(model, args.init)
        print(f"weights initialised from {args.init}", flush=True)
    elif args.input_norm_init:
        mu, sd = feature_stats(model, wavs)
        center_input_conv(model, mu, sd)
        print(f"input conv initialised for log-mel mean {mu:.2f} std {sd:.2f}", flush=True)
    spec_aug = model.spec_augmentation
    centers_hz = mel_centers_hz(model.preprocessor)  # for --vtlp
    tokens = [model.tokenizer.text_to_ids(t) for t in texts]
    if args.eou:  # the EOU recipe (eou.py): <EOU> after each utterance's last word
        eou_id = model.tokenizer.token_to_id(EOU_PIECE)
        tokens = [t + [eou_id] for t in tokens]
    durs = np.array([len(w) / 16000 for w in wavs])
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model params: {n_params / 1e6:.2f}M; vocab {model.tokenizer.vocab_size}", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=1e-3)
    step, best = 0, float("inf")
    # The selection metric: single-utterance dev WER, or (with --dev-chain) its mean with the chained dev WER.
    # Each has its own best in the checkpoint, so switching metric mid-run does not compare unlike numbers.
    best_key = "best_mixed" if chain_wavs else "best"
    bests = {}
    np_rng = np.random.default_rng(args.seed)
    ckpt = out / "last.pt"
    if args.resume and ckpt.exists():
        st = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(st["model"])
        bests = {k: v for k, v in st.items() if k.startswith("best")}
        opt.load_state_dict(st["opt"])
        step, best = st["step"], st.get(best_key, float("inf"))
        np_rng = np.random.default_rng(args.seed + step)
        random.seed(args.seed + step)
        torch.manual_seed(args.seed + step)
        print(f"resumed at step {step}, best dev WER {best:.4f}", flush=True)

    model.train()
    log = open(out / "log.jsonl", "a")
    all_idx = np.arange(len(wavs))
    short_idx = all_idx[durs <= args.short_max]
    batches: list[list[int]] = []
    items: list[tuple[int, ...]] = []

    def epoch(pool: np.ndarray) -> list[list[int]]:
        nonlocal items
        prob = args.chain_prob if step >= args.chain_start else 0.0
        items = make_chains(pool, np_rng, prob, args.chain_max)
        item_durs = np.array([sum(durs[i] for i in it) + 0.3 * (len(it) - 1) for it in items])
        return make_batches(item_durs, np.arange(len(items)), args.batch_seconds, np_rng)

    t_start = time.time()
    loss_ema = None
    result = {}
    while step < args.steps:
        if not batches:
            pool = short_idx if step < args.short_steps and len(short_idx) > 0 else all_idx
            batches = epoch(pool)
        if args.short_steps > 0 and step == args.short_steps:  # curriculum over: all lengths from now on
            batches = epoch(all_idx)
        bidx = batches.pop()
        sig, sig_len, lab, lab_len = collate([join_chain(wavs, items[i], np_rng) for i in bidx],
                                             [[t for j in items[i] for t in tokens[j]] for i in bidx])
        lr = lr_at(step, args.lr, args.warmup, args.steps)
        for g in opt.param_groups:
            g["lr"] = lr
        model.spec_augmentation = spec_aug if step >= args.specaug_start else None
        w_ctc = args.ctc_weight_start if step < args.ctc_warmup else args.ctc_weight

        if args.channel_eq_db > 0 or args.vtlp > 0:
            feats, feat_len = model.preprocessor(input_signal=sig, length=sig_len)
            if args.vtlp > 0:
                feats = random_vtlp(feats, feat_len, np_rng, args.vtlp, centers_hz)
            if args.channel_eq_db > 0:
                feats = random_eq(feats, feat_len, np_rng, args.channel_eq_db)
            enc, enc_len = model.forward(processed_signal=feats, processed_signal_length=feat_len)
        else:
            enc, enc_len = model.forward(input_signal=sig, input_signal_length=sig_len)
        if w_ctc < 1.0:
            dec, tgt_len, _ = model.decoder(targets=lab, target_length=lab_len)
            joint = model.joint(encoder_outputs=enc, decoder_outputs=dec)
            rnnt = rnnt_loss(joint, lab, enc_len, tgt_len, blank=model.decoder.blank_idx)
        else:  # CTC-only warm-up: the encoder must learn acoustics (no prediction-network shortcut)
            rnnt = torch.zeros(())
        lp = model.ctc_decoder(encoder_output=enc)
        ctc = model.ctc_loss(log_probs=lp, targets=lab, input_lengths=enc_len, target_lengths=lab_len)
        loss = (1 - w_ctc) * rnnt + w_ctc * ctc
        opt.zero_grad(set_to_none=True)
        loss.backward()
        loss = loss.detach()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if torch.isfinite(gn):
            opt.step()
        step += 1
        tok = float(lab_len.sum())
        rec = {"step": step, "loss": float(loss), "rnnt_per_tok": float(rnnt.detach()) * len(bidx) / tok,
               "ctc_per_tok": float(ctc) * len(bidx) / tok, "lr": lr, "bs": len(bidx),
               "gn": float(gn), "elapsed_s": round(time.time() - t_start, 1)}
        loss_ema = rec["rnnt_per_tok"] if loss_ema is None else 0.98 * loss_ema + 0.02 * rec["rnnt_per_tok"]
        if step % args.log_every == 0:
            print(f"step {step} loss {rec['loss']:.3f} rnnt/tok {rec['rnnt_per_tok']:.3f} (ema {loss_ema:.3f}) "
                  f"ctc/tok {rec['ctc_per_tok']:.3f} lr {lr:.2e} bs {len(bidx)} gn {rec['gn']:.2f} "
                  f"{rec['elapsed_s'] / step if not args.resume else 0:.2f}s/step", flush=True)
        if args.eval_every and (step % args.eval_every == 0 or step == args.steps) and dev_wavs:
            wer_r, wer_c, samples = offline_wer(model, dev_wavs, dev_texts)
            rec.update({"dev_wer_rnnt": wer_r, "dev_wer_ctc": wer_c})
            print(f"== step {step} dev WER rnnt {wer_r:.4f} ctc {wer_c:.4f} | " +
                  " | ".join(f"{r!r} -> {h!r}" for r, h in samples[:2]), flush=True)
            metric = wer_r
            if chain_wavs:
                wer_k, _, _ = offline_wer(model, chain_wavs, chain_texts, batch_size=8)
                rec["dev_wer_rnnt_chain"] = wer_k
                metric = (wer_r + wer_k) / 2
                print(f"   chained by {args.dev_chain}: rnnt {wer_k:.4f}; selection metric {metric:.4f}", flush=True)
            if metric < best:
                best = metric
                model.spec_augmentation = spec_aug
                model.save_to(str(out / "best.nemo"))
                print(f"   saved best.nemo ({best_key} {best:.4f})", flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if step % args.save_every == 0 or step == args.steps:
            model.spec_augmentation = spec_aug
            bests[best_key] = best
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, **bests},
                       str(ckpt) + ".tmp")
            os.replace(str(ckpt) + ".tmp", ckpt)
        if args.keep_every and step % args.keep_every == 0:
            # The weights of this exact step, kept for checkpoint averaging (average.py). A copy of
            # last.pt taken by hand holds the step of its last save, which may be older.
            model.spec_augmentation = spec_aug
            keep = out / f"step_{step:06d}.pt"
            torch.save({"model": model.state_dict(), "step": step}, str(keep) + ".tmp")
            os.replace(str(keep) + ".tmp", keep)
        result = rec
    model.spec_augmentation = spec_aug
    if args.save_final:
        model.save_to(str(out / "final.nemo"))
    result["best_dev_wer"] = best
    result["model"] = model
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--tokenizer-dir", default=str(DEFAULT_TOKENIZER))
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--encoder-layers", type=int, default=None,
                   help="encoder depth instead of the config's (with --init: instead of that model's); with --init "
                        "from a shallower model its layers are stacked into the deeper one (stack_layers)")
    p.add_argument("--init", default=None,
                   help="fine-tune: start from this .nemo's weights (ignored when --resume finds OUT/last.pt)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--batch-seconds", type=float, default=40.0)
    p.add_argument("--short-max", type=float, default=2.0)
    p.add_argument("--short-steps", type=int, default=600)
    p.add_argument("--ctc-weight", type=float, default=0.3)
    p.add_argument("--ctc-weight-start", type=float, default=1.0)
    p.add_argument("--ctc-warmup", type=int, default=600)
    p.add_argument("--chain-prob", type=float, default=0.0,
                   help="probability that a training item is several utterances streamed as one (make_chains)")
    p.add_argument("--chain-max", type=int, default=3, help="most utterances in one chained item")
    p.add_argument("--chain-start", type=int, default=0, help="step from which items may be chained")
    p.add_argument("--specaug-start", type=int, default=10**9,
                   help="step at which SpecAugment is switched on (configs/demo_model.yaml's spec_augment; "
                        "0: from the start, as in the flite fine-tune; default: never)")
    p.add_argument("--channel-eq-db", type=float, default=0.0,
                   help="random smooth EQ of up to +-DB per mel region on 80%% of the items (random_eq); "
                        "0: off (every run before the third flite fine-tune)")
    p.add_argument("--vtlp", type=float, default=0.0,
                   help="vocal tract length perturbation: features of 80%% of the items warped in frequency by a "
                        "factor in 1 +- W (random_vtlp); 0: off (every run before the fifth flite fine-tune)")
    p.add_argument("--eou", action="store_true",
                   help="append <EOU> to every transcript (--tokenizer-dir: a tokenizer grown by eou.grow_tokenizer)")
    p.add_argument("--train-manifest", default="train.jsonl")
    p.add_argument("--dev-manifest", default="dev.jsonl")
    p.add_argument("--limit", type=int, default=None, help="use only the first N training utterances")
    p.add_argument("--dev-limit", type=int, default=100)
    p.add_argument("--dev-chain", type=int, default=0,
                   help="also score the dev set chained K utterances at a time; best.nemo then minimises the mean")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--keep-every", type=int, default=0,
                   help="also keep the weights of every Nth step as OUT/step_NNNNNN.pt (for average.py); 0: off")
    p.add_argument("--save-final", action="store_true")
    p.add_argument("--no-input-norm-init", dest="input_norm_init", action="store_false",
                   help="keep NeMo's default init of the first subsampling conv (see center_input_conv)")
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    res = train(args)
    res.pop("model", None)
    print(json.dumps(res))


if __name__ == "__main__":
    main()

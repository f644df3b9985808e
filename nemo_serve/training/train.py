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

from .batches import chain_dev, collate, join_chain, load_audio, make_batches, make_chains
from .dev_wer import offline_wer
from .eou import EOU_PIECE, eou_token_ids
from .feature_augment import mel_centers_hz, random_eq, random_vtlp
from .model_setup import (DEFAULT_CONFIG, DEFAULT_TOKENIZER, build_model, center_input_conv, feature_stats, init_depth,
                          init_from, make_tokenizer, seed_all)
from .rnnt_loss import rnnt_loss


def lr_at(step: int, peak: float, warmup: int, total: int, floor: float = 0.05) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


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
    if args.eou:  # the EOU recipe (eou.py): <EOU> after each turn's last word (one turn unless marked)
        eou_id = model.tokenizer.token_to_id(EOU_PIECE)
        tokens = [eou_token_ids(model.tokenizer, t, eou_id) for t in texts]
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
                   help="<EOU> after each turn's words: after the transcript, or after each turn a multi-turn "
                        "transcript marks (eou_corpus --n-train-turns) (--tokenizer-dir: a tokenizer grown by "
                        "eou.grow_tokenizer)")
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

"""Train the demo streaming Sortformer on synthetic conversations, on CPU.

Recipe (configs/demo_sortformer.yaml is the model):

* **Init.** The FastConformer encoder (pre-encode and 4 layers) is copied from the demo ASR model
  (nemo_serve/assets/demo/demo.nemo), as NVIDIA starts Sortformer from a pretrained NEST encoder; the
  projection, Transformer and speaker head start from NeMo's random init.
* **Frozen pre-encode convolutions.** The copied striding convolutions (10 ms log-mels -> 80 ms frames)
  stay as the ASR model trained them (``--train-pre-encode`` trains them too): their backward pass was a
  quarter of a step's CPU time, and the layers above them are where speakers are told apart. Their
  projection is trained: the ASR model subsamples causally, the Sortformer symmetrically (NeMo's streaming
  step counts frames that way), so it starts from the ASR projection's first 10 of 11 frequency bins.
* **Data.** Conversations drawn on the fly from the training bank of ``diar_corpus`` (2-4 speakers of
  distinct timbres, pauses and overlaps), ``--min-s``..``--max-s`` seconds, batches of about
  ``--batch-s`` seconds of audio; the seed fixes the whole stream of conversations.
* **Loss.** NeMo's: BCE against the arrival-time-sorted targets (``get_ats_targets``) and against the
  best permutation (``get_pil_targets``), weighted ``ats_weight``/``pil_weight`` (0.5/0.5), as
  ``SortformerEncLabelModel._get_aux_train_evaluations``.
* **Forward.** Offline over each whole conversation (``frontend_encoder`` + ``forward_infer``), the
  arithmetic each streaming step runs on [speaker cache, FIFO, chunk]; with NeMo's causal-attention
  augmentation (probability ``causal_attn_rate``: encoder ``att_context_size [-1, causal_attn_rc]`` and
  Transformer ``diag``), which NeMo applies in its streaming training loop, so the low-latency settings'
  short right context is seen in training. Training through NeMo's chunked loop costs several times more.
* **Optimiser.** AdamW (0.9/0.98, weight decay 1e-3), linear warm-up to ``--lr`` then cosine to 5%,
  gradients clipped at 1.0.
* **Weight average.** ``--ema D`` keeps an exponential moving average of the weights (decay D per step,
  half-life ln 0.5 / ln D steps); the dev evaluations, ``best.nemo`` and ``ema.nemo`` use it. The dev DER
  of single checkpoints swung by several points from one evaluation to the next; the average is the
  steadier thing to ship.
* **Speaker mix.** ``--speaker-counts 2,3,4,4`` draws each conversation's number of speakers from the
  list (default: 2-4 uniform, as the held-out conversations): more 3-4 speaker conversations give the
  third and fourth outputs more to learn from.
* **Choice.** Every ``--eval-every`` steps the offline DER (no collar) on the dev conversations (training
  speakers); ``best.nemo`` keeps the lowest, ``last.pt`` the latest state (``--resume``).

    OMP_WAIT_POLICY=PASSIVE nice -n 5 python -m nemo_serve.training.diar_train \\
        --data work_data/diar_corpus --out work_data/diar_run --steps 1500 --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from omegaconf import OmegaConf

from ..config_files import config_dir
from .diar_corpus import Bank, frame_targets, make_conversation, read_rttm
from .diar_eval import offline_preds
from .diar_metrics import DerCounts, der_counts, preds_to_segments

REPO = Path(__file__).resolve().parents[2]
DEMO_ASR = REPO / "nemo_serve" / "assets" / "demo" / "demo.nemo"


def build_model(init_encoder: Path | None = DEMO_ASR):
    from nemo.collections.asr.models import SortformerEncLabelModel

    from ..builtin.common import quiet_nemo

    spec = OmegaConf.load(config_dir() / "demo_sortformer.yaml")
    with quiet_nemo():
        model = SortformerEncLabelModel(cfg=spec.model)
    if init_encoder is not None:
        copy_asr_encoder(model, init_encoder)
    return model


def copy_asr_encoder(model, asr_path: Path) -> None:
    """The ASR model's pre-encode and first n_layers encoder layers into the Sortformer's encoder."""
    from nemo.collections.asr.models import ASRModel

    from ..builtin.common import quiet_nemo

    with quiet_nemo():
        asr = ASRModel.restore_from(str(asr_path), map_location="cpu")
    source = asr.encoder.state_dict()
    target = model.encoder.state_dict()
    copied = {k: source[k].float() for k in target if k in source and source[k].shape == target[k].shape}
    # The ASR model subsamples causally (80 mels -> 11 bins per channel), the Sortformer symmetrically (10),
    # as NeMo's streaming step needs: the projection keeps the first 10 bins of each channel and is trained.
    key = "pre_encode.out.weight"
    if key not in copied and key in source:
        d_model, width = target[key].shape
        channels = model.encoder.pre_encode.conv[0].out_channels
        bins = source[key].float().reshape(d_model, channels, -1)
        copied[key] = bins[:, :, : width // channels].reshape(d_model, width)
    missing = [k for k in target if k not in copied and "num_batches_tracked" not in k]
    if missing:
        raise ValueError(f"ASR encoder lacks {len(missing)} Sortformer encoder tensors, e.g. {missing[:3]}")
    model.encoder.load_state_dict({**target, **copied})


def load_trained_weights(model, nemo_path: Path) -> None:
    """A trained Sortformer's weights (the shipped .nemo stores parameters as fp16) into the fp32 model.

    How a run continues when its ``last.pt`` is gone: the shipped weights are the checkpoint; the optimiser
    state is not kept in a .nemo, so AdamW starts afresh (hence a short ``--warmup``).
    """
    from nemo.collections.asr.models import SortformerEncLabelModel

    from ..builtin.common import quiet_nemo

    with quiet_nemo():
        trained = SortformerEncLabelModel.restore_from(str(nemo_path), map_location="cpu")
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in trained.state_dict().items()})


def sortformer_loss(model, preds, targets, target_lens):
    """NeMo's training loss: ats_weight * BCE(arrival-sorted targets) + pil_weight * BCE(best permutation)."""
    from nemo.collections.asr.parts.utils.asr_multispeaker_utils import get_ats_targets, get_pil_targets

    # the last output frame may cover only padding features: no one speaks there
    targets = torch.nn.functional.pad(targets, (0, 0, 0, max(0, preds.shape[1] - targets.shape[1])))
    targets = targets[:, : preds.shape[1]].to(preds.dtype)
    target_lens = target_lens.clamp(max=preds.shape[1])
    ats = get_ats_targets(targets.clone(), preds, speaker_permutations=model.speaker_permutations)
    pil = get_pil_targets(targets.clone(), preds, speaker_permutations=model.speaker_permutations)
    ats_loss = model.loss(probs=preds, labels=ats, target_lens=target_lens)
    pil_loss = model.loss(probs=preds, labels=pil, target_lens=target_lens)
    return model.ats_weight * ats_loss + model.pil_weight * pil_loss


def make_batch(bank: Bank, rng: random.Random, batch_s: float, min_s: float, max_s: float,
               speaker_counts: tuple[int, ...] | None = None):
    """(audio [B, N], audio_lens [B], targets [B, T, 4], target_lens [B]) of fresh conversations.

    Each conversation's number of speakers is drawn from speaker_counts (repeat a count to weight it); None:
    make_conversation's own 2-4, uniform (the earlier runs' stream of conversations, unchanged).
    """
    convs, total = [], 0.0
    while total < batch_s:
        count = rng.choice(speaker_counts) if speaker_counts else None
        if count is None:
            convs.append(make_conversation(bank, rng, min_s, max_s))
        else:
            convs.append(make_conversation(bank, rng, min_s, max_s, min_speakers=count, max_speakers=count))
        total += convs[-1].duration_s
    lens = [len(c.audio) for c in convs]
    audio = torch.zeros(len(convs), max(lens))
    frames = [math.ceil(n / 1280) for n in lens]  # 80 ms output frames
    targets = torch.zeros(len(convs), max(frames), 4)
    for i, conv in enumerate(convs):
        audio[i, : lens[i]] = torch.from_numpy(conv.audio)
        targets[i, : frames[i]] = torch.from_numpy(frame_targets(conv.segments, frames[i]))
    return audio, torch.tensor(lens), targets, torch.tensor(frames)


def train_forward(model, audio, audio_lens, rng: random.Random):
    """Offline forward with NeMo's causal-attention augmentation (what its streaming training loop does)."""
    modules = model.sortformer_modules
    causal = rng.random() < modules.causal_attn_rate
    if causal:
        model.encoder.att_context_size = [-1, modules.causal_attn_rc]
        model.transformer_encoder.diag = modules.causal_attn_rc
    try:
        features, feature_lens = model.process_signal(audio_signal=audio, audio_signal_length=audio_lens)
        features = features[:, :, : int(feature_lens.max())]
        embs, emb_lens = model.frontend_encoder(processed_signal=features, processed_signal_length=feature_lens)
        return model.forward_infer(embs, emb_lens)
    finally:
        if causal:
            model.encoder.att_context_size = [-1, -1]
            model.transformer_encoder.diag = None


class WeightEma:
    """Exponential moving average of a model's floating-point state (parameters and buffers), kept in fp32.

    ``update`` after each optimiser step; ``applied`` swaps the average into the model (to evaluate or save
    it) and puts the trained weights back afterwards, so training continues from its own weights.
    """

    def __init__(self, model, decay: float):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model) -> None:
        for name, value in model.state_dict().items():
            if value.is_floating_point():
                self.state[name].lerp_(value, 1.0 - self.decay)
            else:  # counters: the latest
                self.state[name].copy_(value)

    @contextmanager
    def applied(self, model):
        trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(self.state)
        try:
            yield model
        finally:
            model.load_state_dict(trained)


def dev_der(model, dev_manifest: Path) -> float:
    """Offline DER (no collar) over the dev conversations."""
    import soundfile as sf

    model.eval()
    counts = DerCounts()
    for line in open(dev_manifest):
        row = json.loads(line)
        audio, _ = sf.read(dev_manifest.parent / row["audio_filepath"], dtype="float32")
        preds = offline_preds(model, torch.from_numpy(audio))
        hyp = preds_to_segments(preds.numpy())
        counts += der_counts(read_rttm(dev_manifest.parent / row["rttm_filepath"]), hyp, row["duration"], collar_s=0.0)
    model.train()
    return counts.der


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--batch-s", type=float, default=120.0, help="seconds of conversation per batch")
    p.add_argument("--min-s", type=float, default=10.0)
    p.add_argument("--max-s", type=float, default=40.0)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-init", action="store_true", help="random encoder instead of the demo ASR model's")
    p.add_argument("--train-pre-encode", action="store_true")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--init-from", type=Path, help="start from this .nemo's weights (no last.pt to resume)")
    p.add_argument("--ema", type=float, default=0.0, help="EMA decay per step of the evaluated/shipped weights")
    p.add_argument("--speaker-counts", default=None, help="speakers per conversation, drawn from e.g. 2,3,4,4")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    a.out.mkdir(parents=True, exist_ok=True)
    model = build_model(None if a.no_init else DEMO_ASR).train()
    if a.init_from is not None:
        load_trained_weights(model, a.init_from)
    if not a.train_pre_encode:
        model.encoder.pre_encode.conv.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(trained, lr=a.lr, betas=(0.9, 0.98), weight_decay=1e-3)
    ema = WeightEma(model, a.ema) if a.ema else None
    start, best = 0, float("inf")
    if a.resume and (a.out / "last.pt").exists():
        state = torch.load(a.out / "last.pt", weights_only=False)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start, best = state["step"], state["best"]
        if ema is not None:
            ema.state = state.get("ema") or ema.state
    elif a.init_from is not None:  # the weights continued from are the bar a new best.nemo must clear
        best = dev_der(model, a.data / "dev.jsonl")
        print(f"step 0 dev DER {best:.4f} ({a.init_from.name})", flush=True)
    speaker_counts = tuple(int(n) for n in a.speaker_counts.split(",")) if a.speaker_counts else None
    bank = Bank(a.data / "bank_train.jsonl")
    rng = random.Random(a.seed * 7919 + start)  # a resumed run draws new conversations
    t0 = time.time()
    for step in range(start, a.steps):
        for group in optim.param_groups:
            group["lr"] = lr_at(step, a.lr, a.warmup, a.steps)
        audio, audio_lens, targets, target_lens = make_batch(bank, rng, a.batch_s, a.min_s, a.max_s, speaker_counts)
        preds = train_forward(model, audio, audio_lens, rng)
        loss = sortformer_loss(model, preds, targets, target_lens)
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optim.step()
        if ema is not None:
            ema.update(model)
        if (step + 1) % 10 == 0:
            print(f"step {step + 1} loss {loss.item():.4f} lr {optim.param_groups[0]['lr']:.2e} "
                  f"{(time.time() - t0) / (step + 1 - start):.2f} s/step", flush=True)
        if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
            if ema is not None:  # the trained weights' own, to see what the average smooths
                print(f"step {step + 1} dev DER {dev_der(model, a.data / 'dev.jsonl'):.4f} (trained)", flush=True)
            with ema.applied(model) if ema is not None else nullcontext(model):
                der = dev_der(model, a.data / "dev.jsonl")
                print(f"step {step + 1} dev DER {der:.4f}{' (EMA)' if ema is not None else ''}", flush=True)
                if der < best:
                    best = der
                    model.save_to(str(a.out / "best.nemo"))
                if ema is not None:
                    model.save_to(str(a.out / "ema.nemo"))
            torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": step + 1, "best": best,
                        "ema": ema.state if ema is not None else None}, a.out / "last.pt")
    print(f"done: best dev DER {best:.4f}", flush=True)


if __name__ == "__main__":
    main()

"""How and why the built-ins' random weights are shaped.

With NeMo's random init the greedy decoder emits max_symbols tokens on every frame, so token
parity on it proves little and it costs a server far more decoder work than a real model.
After NeMo's init (LayerNorm gains/biases and pos_bias_u/v randomised too, so that a runtime
that drops one of them cannot match) the joint and the predictor are rebuilt around "token
groups" that stand in for acoustic content:
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
not a recogniser: its text is gibberish. The joint and CTC heads are shaped in joint.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from ..engine.step import apply_prompt
from ..synth import SAMPLE_RATE, synth_audio
from .common import phase, randn
from .joint import JointLayout, shape_ctc, shape_joint

# Calibration audio seeds live far from the small seeds tests use for their own audio.
_CALIBRATION_AUDIO_SEED = 0xCA1B


@dataclass
class RandomInitRecipe:
    """Knobs of the weight adjustment; defaults suit every built-in, a config's `random_init` may override."""

    target_emitting_frames: float = 0.32  # fraction of encoder frames with >= 1 token (calibration audio)
    calibration_utterances: int = 8  # 8 s each, round-robin over the context modes
    layer_norm_gain_std: float = 0.2  # log-normal LayerNorm gains
    layer_norm_bias_std: float = 0.1
    pos_bias_std: float = 0.3  # rel-pos attention pos_bias_u / pos_bias_v
    prompt_scale: float = 0.3  # language offsets in prompt_kernel's hidden units / their spread over frames
    tokens_per_group: float = 3.0  # vocabulary / number of token groups (see JointLayout.make)
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
    # TEST-ONLY knobs of tiny-eou (configs/tiny-eou.yaml): added to the <EOU> / <EOB> logits after
    # calibration, so a random model emits them often enough for protocol tests to see EOU endings
    # within a few seconds of audio, the same ones on every run (seeded weights). Not a model of
    # when an utterance ends: the demo EOU model (docs/demo_model.md) is trained for that.
    eou_logit_bias: float = 0.0
    eob_logit_bias: float = 0.0


def shape_weights(model, recipe: RandomInitRecipe, gen: torch.Generator, timings: dict) -> None:
    _randomise_encoder_norms(model.encoder, recipe, gen)
    joint = model.joint
    layout = JointLayout.make(
        joint.enc.weight.shape[0], joint.pred.weight.shape[1], joint.num_classes_with_blank - 1, recipe, gen
    )
    register_levels = _shape_predictor(model.decoder, layout, recipe, gen)
    with phase(timings, "encode"):
        encoded, quiet, probes = _calibration_encoder_outputs(model, recipe)
    frames, silences = encoded, [quiet]  # [T, D] each, as the joint sees them
    if getattr(model, "concat", False):
        _shape_prompt_kernel(model.prompt_kernel, model.num_prompts, encoded, recipe, gen)
        frames, silences = _apply_prompts(model, encoded, quiet)
        probes = [_apply_prompt(model, p, 0) for p in probes]
    with phase(timings, "joint"):
        shape_joint(model, layout, register_levels, frames, silences, probes, recipe, gen)
    if hasattr(model, "ctc_decoder"):
        shape_ctc(model, frames, recipe, gen)
    _bias_end_of_utterance(model, recipe)
    model.encoder.set_default_att_context_size(list(model.encoder.att_context_size_all[0]))


def _bias_end_of_utterance(model, recipe: RandomInitRecipe) -> None:
    """The test-only <EOU>/<EOB> logit offsets (RandomInitRecipe), by piece: no fixed ids."""
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None or not (recipe.eou_logit_bias or recipe.eob_logit_bias):
        return
    out = model.joint.joint_net[-1]
    for piece, offset in (("<EOU>", recipe.eou_logit_bias), ("<EOB>", recipe.eob_logit_bias)):
        ids = [i for i in range(tokenizer.vocab_size) if tokenizer.ids_to_tokens([i])[0] == piece]
        if offset and not ids:
            raise ValueError(f"random_init biases {piece}, but the tokenizer has no such piece")
        for i in ids:
            out.bias[i] += offset


def _randomise_encoder_norms(encoder, recipe, gen) -> None:
    """Non-trivial LayerNorm gains/biases and pos_bias_u/v: a runtime that drops one of them must not match."""
    for module in encoder.modules():
        if isinstance(module, torch.nn.LayerNorm) and module.elementwise_affine:
            module.weight.copy_(torch.exp(recipe.layer_norm_gain_std * randn(gen, module.weight.shape)))
            module.bias.copy_(recipe.layer_norm_bias_std * randn(gen, module.bias.shape))
        for attr in ("pos_bias_u", "pos_bias_v"):
            param = module._parameters.get(attr)
            if param is not None:
                param.copy_(recipe.pos_bias_std * randn(gen, param.shape))


def _shape_prompt_kernel(prompt_kernel, num_prompts: int, encoded, recipe, gen) -> None:
    """Make the language one-hot move prompt_kernel's hidden units by `prompt_scale` times the
    spread the encoder output gives them: enough to change tokens, not the emission rate."""
    first = prompt_kernel[0]  # Linear(D + P, 2D); the one-hot is concatenated after the encoder output
    spread = (torch.cat(encoded) @ first.weight[:, :-num_prompts].T).std(0)  # [2D]
    offsets = recipe.prompt_scale * spread[:, None] * randn(gen, (first.weight.shape[0], num_prompts))
    first.weight[:, -num_prompts:] = offsets


def _shape_predictor(decoder, layout: JointLayout, recipe, gen) -> tuple[float, float]:
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
    protos = torch.linalg.qr(randn(gen, (hidden, groups)))[0].T  # [G, Hp], orthonormal rows
    rand = embed[:vocab] - (embed[:vocab] @ protos.T) @ protos
    embed[:vocab] = rand + 4.0 * protos[layout.group_of]
    last, prev, registers = slice(0, groups), slice(groups, 2 * groups), slice(0, 2 * groups)
    eye = torch.eye(hidden)
    for layer in range(lstm.num_layers):
        w_ih, w_hh = getattr(lstm, f"weight_ih_l{layer}"), getattr(lstm, f"weight_hh_l{layer}")
        b_ih, b_hh = getattr(lstm, f"bias_ih_l{layer}"), getattr(lstm, f"bias_hh_l{layer}")
        b_hh.zero_()
        b_ih.copy_(0.1 * randn(gen, b_ih.shape))  # gate blocks: input, forget, cell, output
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


def _apply_prompt(model, encoded: torch.Tensor, lang: int) -> torch.Tensor:
    """[T, D] encoder output -> [T, D] joint input, with the engine's own prompt code (one row)."""
    served = SimpleNamespace(nemo=model, num_prompts=model.num_prompts)  # what apply_prompt reads of a ServedModel
    return apply_prompt(served, encoded.T[None], torch.tensor([lang]))[0].T

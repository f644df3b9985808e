"""The joint rebuilt around token groups, and the CTC head of hybrid models (why: weights.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
import numpy as np
import torch

from .common import UNK_LOGIT, randn64, unk_id
from .simulate import calibrate_blank


@dataclass
class JointLayout:
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
    def make(hidden: int, pred_hidden: int, vocab: int, recipe, gen) -> "JointLayout":
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
        return JointLayout(*spans, group_of=group_of, follower_of=follower_of)


def shape_joint(model, lay: JointLayout, register_levels, frames, silences, probes, recipe, gen) -> None:
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
    unk = unk_id(model)
    if unk is not None:
        w_out[unk], b_out[unk] = 0.0, UNK_LOGIT
    layers = ((joint.enc, w_enc, b_enc), (joint.pred, w_pred, b_pred), (joint.joint_net[-1], w_out, b_out))
    for layer, weight, bias in layers:
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    _fit_blank_and_followers(model, lay, [joint.project_encoder(f) for f in frames], recipe)


def _joint_encoder_side(x, silences, probes, lay: JointLayout, gen) -> tuple[torch.Tensor, torch.Tensor]:
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
        w = randn64(gen, (rows, x.shape[1]))
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


def _joint_predictor_side(h, lay: JointLayout, register_levels, recipe, gen):
    """joint.pred: gates and flags read the predictor's group registers; the variation units get a
    random image of the label (-suppress times the one its tokens read, + pred_noise times another).
    Returns (weight, bias, readout [V, num_var] of each token on the variation units)."""
    hidden, groups = lay.variation.stop, lay.num_groups
    num_var = hidden - lay.variation.start

    def label_directions(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Random predictor directions (weight, bias) with zero-mean unit-std outputs over labels, and the outputs."""
        w = randn64(gen, (rows, h.shape[1]))
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


def _joint_output_layer(x, h, enc, pred, readout, lay: JointLayout, recipe, gen):
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


def _fit_blank_and_followers(model, lay: JointLayout, projected, recipe) -> None:
    """Set the follower boosts and the blank bias on the joint-projected calibration frames."""
    out, blank = model.joint.joint_net[-1], len(lay.group_of)
    # A rough bias from every other sequence first (it only sets the follower boost), then the fit.
    blank_bias = calibrate_blank(model, projected[::2], recipe.target_emitting_frames, -20.0, 40.0, rounds=2)
    # Followers: after a label of group j, group follower_of[j] gets the blank bias + a margin, so it
    # usually comes out in the same frame (frames with 2-3 tokens); then the blank bias is re-fitted.
    boost = blank_bias + recipe.follow_margin * recipe.group_scale
    for group, follower in enumerate(lay.follower_of.tolist()):
        if follower >= 0:
            followers = (lay.group_of == follower).nonzero()[:, 0]
            out.weight[followers, lay.last_flag.start + group] = boost
    out.bias[blank] = calibrate_blank(
        model, projected, recipe.target_emitting_frames, blank_bias - 2.0, blank_bias + 8.0, rounds=2
    )


def _main_directions(vectors: torch.Tensor, max_count: int) -> torch.Tensor:
    """Orthonormal rows spanning the strong part (singular values over 5% of the largest) of `vectors`."""
    _, strength, directions = torch.linalg.svd(vectors, full_matrices=False)
    return directions[strength > 0.05 * strength[0]][:max_count]


def shape_ctc(model, frames, recipe, gen) -> None:
    """Hybrid models: whitened random CTC head, blank bias at the quantile giving the target rate."""
    conv = model.ctc_decoder.decoder_layers[0]  # Conv1d(D, V + 1, 1)
    x = torch.cat(frames).double()
    mu, sigma = x.mean(0), x.std(0) + 1e-6
    num_classes = conv.weight.shape[0]
    blank = num_classes - 1
    w = randn64(gen, (num_classes, x.shape[1])) / sigma
    w *= recipe.group_scale / ((x - mu) @ w.T).std(0)[:, None]
    b = -(w @ mu)
    w[blank], b[blank] = 0.0, 0.0
    unk = unk_id(model)
    if unk is not None:
        w[unk], b[unk] = 0.0, UNK_LOGIT
    logits = x @ w.T + b
    best_token = logits[:, :blank].max(-1).values
    b[blank] = torch.quantile(best_token, 1.0 - recipe.target_emitting_frames)
    conv.weight.copy_(w[:, :, None])
    conv.bias.copy_(b)

"""Offline dev WER during training: greedy RNN-T and CTC over whole utterances."""

from __future__ import annotations

import torch

from ..scoring import word_errors
from .batches import collate
from .eou import strip_eou


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

"""Word confidence computed apart from the engine and NeMo's confidence code (test_words.py,
test_eou_server.py)."""

from __future__ import annotations

import torch

from nemo_serve.oracle import oracle_transcribe


def nemo_max_prob(model, audio, context_right: int) -> tuple[list[int], list[float]]:
    """Tokens and confidences computed apart from the engine and from NeMo's confidence code: the
    encoder frames of NeMo's own loop (caught on their way to its decoder), a plain greedy RNN-T
    decode over them (at most `max_symbols` labels a frame), and at each emission the softmax of
    the joint's logits, its largest value p mapped as docs/protocol.md says: (p - 1/N) / (1 - 1/N),
    N the labels with blank."""
    nemo = model.nemo
    encoded: list[torch.Tensor] = []
    real = nemo.decoding.rnnt_decoder_predictions_tensor

    def spy(*args, encoder_output, encoded_lengths, **kw):
        encoded.append(encoder_output[0, :, : int(encoded_lengths[0])].T)  # [T, D]
        return real(*args, encoder_output=encoder_output, encoded_lengths=encoded_lengths, **kw)

    nemo.decoding.rnnt_decoder_predictions_tensor = spy  # an instance attribute over the method
    try:
        loop_ids = oracle_transcribe(model, audio, context_right=context_right).token_ids
    finally:
        del nemo.decoding.rnnt_decoder_predictions_tensor
    frames = torch.cat(encoded)[None]  # [1, T, D]
    blank = nemo.decoder.blank_idx
    max_symbols = nemo.decoding.decoding.max_symbols or 10
    ids, confs, label, state = [], [], None, None
    with torch.no_grad():
        g, state = nemo.decoder.predict(None, state, add_sos=False, batch_size=1)
        for t in range(frames.shape[1]):
            for _ in range(max_symbols):
                probs = torch.softmax(nemo.joint.joint(frames[:, t : t + 1], g)[0, 0, 0].double(), -1)
                label = int(probs.argmax())
                if label == blank:
                    break
                n = probs.numel()
                ids.append(label)
                confs.append(float((probs[label] - 1 / n) / (1 - 1 / n)))
                g, state = nemo.decoder.predict(torch.tensor([[label]]), state, add_sos=False, batch_size=1)
    assert ids == loop_ids, "the plain greedy decode must retrace NeMo's loop for its confidences to be its"
    return ids, confs

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
  tiny-eou         tiny-hybrid with <EOU> and <EOB> pieces (user-defined SentencePiece symbols) and a
                   TEST-ONLY logit bias that makes them frequent (configs/tiny-eou.yaml): EOU parity
                   and protocol tests (engine/eou.py)
  fastconformer-l  the stt_en_fastconformer_hybrid_large_streaming_multi architecture: hybrid,
                   17 x 512, 8 heads, 80 mels, L 70, R {13,6,1,0}, LSTM 640, joint 640, 1024 pieces
  nemotron-0.6b    the Nemotron 3.5 ASR streaming 0.6B architecture: prompt model, 24 x 1024,
                   8 heads, 128 mels, L 56, R {13,6,3,0}, 2-layer LSTM 640, joint 640,
                   128 prompts (32 language codes), 13,087 pieces incl. <unk> + blank = 13,088
                   joint outputs (a [13,088 x 640] output layer)

The modules, by job: build (construct and seed), tokenizer (SentencePiece models trained in
code), weights and joint (how and why the random weights are shaped), simulate (the batched
greedy decoder the calibration runs), measure (`python -m nemo_serve.builtin`: emission per
mode), spec (the names and their yaml). This file imports only spec: the server pays for the rest
only when asked for a built-in.
"""

from __future__ import annotations

from .spec import BUILTIN_NAMES, builtin_spec, is_builtin

__all__ = ["BUILTIN_NAMES", "build_builtin", "builtin_spec", "is_builtin"]  # the package's API


def build_builtin(name: str, seed: int = 0):
    """Build the named architecture with seeded, non-degenerate random weights (eval mode, CPU, fp32); see build.py."""
    from .build import build

    return build(name, seed)

"""NeMo's label-looping computer as the step runs it (engine/step.py's `Stepper` mixes this in): which
decoder a step runs, one computer per bucket (captured once on CUDA, with a fallback through NeMo's graph
modes), token confidence and phrase boosting as copies of the computer, and the LSTM's CPU kernel.

Token confidence (`StepBatch.confidence`, the server's --word-confidence): the decoder runs as a
copy of NeMo's computer with its own step confidence on (`confidence_computer`): the normalised
probability of each emitted label under the joint's softmax at the frame it was emitted, from the
logits the decoder computes anyway. Labels are still the argmax of the same logits, so no token
changes (tests/test_words.py runs the parity scenarios with it on); the cost is a log-softmax per
label iteration (benchmarks/confidence_bench.py). The float32 values are bit-cast into the same
int32 buffer, after the frames, so the step keeps its one copy.

Phrase boosting (engine/biasing.py): a step with at least one boosted row runs a copy of the
computer with NeMo's per-stream biasing on, given each row's multi-model id (-1 for unboosted and
padded rows) and tree state from the slot table; a step without one runs the plain computer, so
streams without phrases pay nothing while no boosted stream shares their step. On CUDA the
biasing computer is one more decoder per bucket, captured (with NeMo's Triton multi-model
kernel inside its graph) at the bucket's first boosted step rather than at start-up, so a server
that never boosts holds no multi-model; without Triton NeMo cannot put the multi-model in a graph
and that decoder runs eagerly (`biasing_computer`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback

import torch

from ..nemo_private import computer_copy, set_confidence_method
from .biasing import biasing_computer
from .device_state import restore_device_state

log = logging.getLogger(__name__)


@contextlib.contextmanager
def aten_rnn(device: torch.device, dtype: torch.dtype):
    """On CPU in fp32, run the prediction network's LSTM on ATen's GEMM cell instead of oneDNN's.

    oneDNN's LSTM reorders its weights on every call. The label-looping decoder calls it once per
    emitted label with a single time step, so the reorder costs more than the arithmetic. In fp32
    the two differ only in the order of float operations, as the key/value-cached encoder does,
    and tokens stay identical to NeMo's loop (parity tests). Not in bf16: without oneDNN every
    GEMM of the decoder (LSTM and joint) rounds to bf16 in other places than NeMo's loop does,
    which changes tokens (test_prompt_model_bf16_mixed_languages_match_oracle fails with it). The
    flag is process-wide; only the step loop thread runs the model, and it is restored at once.
    torch's public switch (torch.backends.mkldnn.enabled), not its `flags()` context manager,
    which also resets oneDNN's determinism, TF32 and fp32-precision settings for the block.
    """
    mkldnn = torch.backends.mkldnn
    if device.type != "cpu" or dtype != torch.float32 or not mkldnn.enabled:
        yield
        return
    mkldnn.enabled = False
    try:
        yield
    finally:
        mkldnn.enabled = True


class NemoComputers:
    """The `Stepper`'s NeMo computers: per (bucket, confidence, boosted) in `_computers`, their bases per
    (confidence, boosted) in `_bases`, and what each bucket's first call came to (`decoder_modes`,
    `decoder_failures`); the attributes are the Stepper's (set in its __init__)."""

    def computer(self, bucket: int):
        """NeMo's label-looping computer for this bucket. On CPU the model's own (no graphs); on
        CUDA a shallow copy per bucket, so its graph and buffers are sized for that bucket and
        captured once (`prepare`), not re-captured whenever the batch reaches a new maximum.

        Its buffers are sized for one chunk: NeMo sizes them for max(T, 375) encoder frames
        (INITIAL_MAX_TIME; hypotheses of 375 x max_symbols labels, cloned on every call), where a
        chunk has `new_frames` (1 to 14). The stepper's shapes are static, so no input is longer;
        one that were would make NeMo re-size and re-capture (`need_reinit`) outside the memory
        pool `_first_decode` gives the capture."""
        base = self._base()
        if not self.cuda or getattr(base, "cuda_graphs_mode", None) is None:
            return base
        key = (bucket, self.confidence, self.boosted)
        c = self._computers.get(key)
        if c is None:
            c = computer_copy(base, max_time=self.decoder_max_time)
            if not self.use_graphs or self.decoder_graph_mode == "off":
                c.cuda_graphs_mode = None  # NeMo's torch_impl (graphs=False: the eager reference)
            elif self.decoder_graph_mode == "no_while_loops":
                c.cuda_graphs_mode = type(c).CudaGraphsMode.NO_WHILE_LOOPS
            self._computers[key] = c
            if self.boosted:  # a grown multi-model moves its buffers: capture this bucket again
                self.pool.biasing.on_reallocate.append(lambda: self._forget_decoder(key))
        return c

    def _base(self):
        """The model's computer, with token confidence and/or per-stream biasing as the part needs."""
        key = (self.confidence, self.boosted)
        base = self._bases.get(key)
        if base is None:
            base = self.model.decoding_computer
            if self.confidence:
                base = confidence_computer(base)
            if self.boosted:
                base = biasing_computer(base, self.pool.biasing.multi_model)
            self._bases[key] = base
        return base

    def _forget_decoder(self, key) -> None:
        c = self._computers.get(key)
        if c is not None:
            c.reset_cuda_graphs_state()
        self.decoder_modes.pop(key, None)

    def _first_decode(self, key: tuple[int, bool, bool], encoded: torch.Tensor, encoded_len: torch.Tensor, state,
                      bias: dict):  # fmt: skip
        """The first call of a bucket's decoder, where NeMo captures its CUDA graph. NeMo falls back
        from full graph to no-while-loops only on its own compile errors; anything else (its
        capture-status assertion, an error inside a while-loop body, which also leaves the body's
        stream current) would escape and fail every step of this mode. So any failure is logged
        with its traceback, the device state is restored (synchronize, default stream) and the
        bucket retried in the next mode: full graph -> no while loops -> no graphs (torch_impl).
        The inputs are untouched by a failed attempt: the results are written back only after.

        Every allocation of the capture goes to a memory pool of the computer's own, kept as long as
        it lives. NeMo captures its full graph's while-loop bodies on streams of its own through
        cudaStreamBeginCaptureToGraph, which PyTorch's allocator does not route to the graph's
        private pool: their temporaries came from the shared cache, so any later allocation could
        take that memory while the graph still writes it, and the next torch.cuda.graph capture
        (which empties the cache) freed it. Measured on the H200: an illegal memory access at the
        decoder's first replay after our encoder graphs were captured (benchmarks/gpu/diagnose.py)."""
        c = self.computer(key[0])
        while True:
            mode = getattr(c, "cuda_graphs_mode", None) if self.cuda else None  # CPU: always torch_impl
            try:
                if self.fail_next_decoder_capture:
                    self.fail_next_decoder_capture = False
                    raise AssertionError("forced decoder capture failure (fail_next_decoder_capture)")
                own_pool = contextlib.nullcontext()
                if mode is not None and encoded.is_cuda:
                    c._nemo_serve_mempool = torch.cuda.MemPool()  # lives with the computer and its graph
                    own_pool = torch.cuda.use_mem_pool(c._nemo_serve_mempool)
                with own_pool:
                    out = c(x=encoded.transpose(1, 2), out_len=encoded_len, prev_batched_state=state, **bias)
            except Exception as e:  # noqa: BLE001 - any capture failure; the last mode re-raises
                forced = str(e).startswith("forced decoder capture failure")
                log.warning("decoder of bucket %d (confidence %s) failed in mode %s; retrying in the next mode",
                            key[0], key[1], _mode_name(mode), exc_info=True)  # fmt: skip
                self.decoder_failures.append({"bucket": key[0], "confidence": key[1], "mode": _mode_name(mode),
                                              "error": f"{type(e).__name__}: {e}"[:500],
                                              "traceback": traceback.format_exc()[-2000:]})  # fmt: skip
                if mode is None:
                    if forced:
                        continue  # the same call again: what a retry without graphs is
                    raise
                restore_device_state(self.device)
                c.reset_cuda_graphs_state()
                c.cuda_graphs_mode = _next_mode(c, mode)
                continue
            self.decoder_modes[key] = _mode_name(mode)
            return out


DECODERS = ("label_loop", "nemo")


def decoder_kind(device: torch.device) -> str:
    """Which RNN-T decoder the step runs: `label_loop` (engine/label_loop.py, ours) or `nemo` (NeMo's
    label-looping computer, the reference; on CUDA in its graph mode). NEMO_SERVE_DECODER picks one.
    Default: ours on the CPU, where every parity test and the selftest pass with it; NeMo's on
    CUDA until a GPU run has shown ours token-identical and not slower (benchmarks/gpu/README.md)."""
    kind = os.environ.get("NEMO_SERVE_DECODER") or ("nemo" if device.type == "cuda" else "label_loop")
    if kind not in DECODERS:
        raise ValueError(f"NEMO_SERVE_DECODER={kind!r}: one of {', '.join(DECODERS)}")
    return kind


def decoder_name(device: torch.device) -> str:
    """The decoder a step on `device` runs, as the selftest and the start-up report say it."""
    kind = decoder_kind(device)
    return kind if kind == "nemo" else f"{kind}/{os.environ.get('NEMO_SERVE_LABEL_LOOP_ROWS', 'all')}"


def _mode_name(mode) -> str:
    return "no_graphs" if mode is None else str(getattr(mode, "name", mode)).lower()


def _next_mode(computer, mode):
    """full graph -> no while loops -> None (torch_impl)."""
    modes = type(computer).CudaGraphsMode
    return modes.NO_WHILE_LOOPS if mode is modes.FULL_GRAPH else None


def confidence_computer(base):
    """A shallow copy of NeMo's label-looping computer that also records each emitted label's
    confidence (`hyps.step_confidence`): NeMo's `max_prob` measure with alpha 1, the label's
    softmax probability p over the V + 1 outputs (blank included) at the frame it was emitted,
    mapped linearly from [1/(V+1), 1] to [0, 1]. Only the emitted labels' steps are recorded
    (NeMo's exclude_blank_from_confidence), so the hypotheses keep their usual layout."""
    c = computer_copy(base)
    c.preserve_step_confidence = True
    set_confidence_method(c, {"name": "max_prob", "alpha": 1.0})
    return c

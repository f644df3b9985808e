"""One batched model step over a group of slots: encoder chunk + prompt + RNN-T greedy decoding.

All rows of one call share the chunk mode (a stream's own; one Stepper per mode), the drop count (first chunks drop
0, later chunks drop 2) and the chunk width (only a stream's final chunk may be shorter: its
cache is discarded afterwards, and the encoder masks its padding). Mixing first and later chunks,
or unequal widths, would change the drop or pad a row that the cache keeps: not NeMo's arithmetic.

Static shapes. A call over n rows runs at the smallest batch bucket >= n (engine/buckets.py), at
the mode's full chunk width: rows past n point at the pool's scratch slot (their results are
dropped, their decoder length is 0), and a short final chunk is zero-padded to the full width and
masked by its length, as a short chunk beside full ones always was. Every input goes into a
persistent buffer sliced to the bucket, so one bucket always reads and writes the same memory:
what a CUDA graph needs (engine/cuda_graphs.py), and on CPU the same code runs eagerly. More
than `pool.max_step_rows` rows are split into several steps.

Launch, then collect (vLLM v1's `step_with_batch_queue`). `launch` stages a batch, enqueues every
part's device work and returns a `LaunchedStep` at once; `collect` waits for it and unpacks the
results. One host-device synchronisation per step, in `collect`. Rows, lengths, languages and
host-side features go through host staging buffers (pinned on CUDA) and non-blocking copies into
the device buffers; tensors already on the device are copied device to device. The decoder's
results are packed on the device as int32 at the width a step can fill (new encoder frames x
max_symbols) and come back in one non-blocking copy into the same staging set. A staging set
belongs to one launched part from launch to collect (`Staging`), so the host may stage and launch
the next step while this one runs without waiting to reuse a buffer: sets are double-buffered and
more are made only if more parts are in flight at once. The device buffers are single: the
device's stream orders the next step's copies into them after this step's reads (and CUDA graphs
need their addresses fixed). `run` is `collect(launch(batch))`, the synchronous step.

The decoder half: engine/label_loop.py (ours) or NeMo's computer (engine/nemo_decoder.py, with token
confidence and phrase boosting).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from .buckets import bucket_for, bucket_sizes, split
from .label_loop import ROW_MODES, label_loop
from .nemo_decoder import NemoComputers, aten_rnn, decoder_kind, decoder_name
from .slots import SlotPool
from .staging import LaunchedPart, LaunchedStep, StagingSets, stage_features, stage_languages, stage_rows


@dataclass
class StepBatch:
    rows: torch.Tensor | np.ndarray  # [B] slot indices (a tensor on any device, or a numpy array)
    features: torch.Tensor  # [B, F, W] fp32, new frames only (right-padded)
    num_frames: list[int]  # new frames per row (<= W)
    is_first: bool  # first chunks: no pre-encode history, drop 0
    languages: torch.Tensor | np.ndarray | None  # [B] prompt index per row (prompt models)
    context_right: int | None = None  # the rows' chunk mode (None: the model's default)
    confidence: bool = False  # also return each new token's confidence (module docstring)


@dataclass
class StepResult:
    token_ids: list[list[int]]  # new tokens per row
    token_frames: list[list[int]]  # global encoder frame of each new token
    decoded_frames: list[int]  # encoder frames decoded per row after this step
    token_confidences: list[list[float]] | None = None  # per new token, in [0, 1] (batch.confidence)


def apply_prompt(model, encoded: torch.Tensor, languages: torch.Tensor) -> torch.Tensor:
    """Per-row language prompt: what PromptStreamingMixin._apply_prompt_to_encoded does for one
    global language, with a one-hot per row so one batch can mix languages."""
    x = encoded.transpose(1, 2)  # [B, T, D]
    b, t, _ = x.shape
    prompt = torch.zeros(b, t, model.num_prompts, dtype=x.dtype, device=x.device)
    prompt.scatter_(2, languages.view(b, 1, 1).expand(-1, t, -1), 1.0)
    out = model.nemo.prompt_kernel(torch.cat([x, prompt], dim=-1)).to(x.dtype)
    return out.transpose(1, 2)  # [B, D, T]


class Stepper(NemoComputers):
    """The bucketed step of one (model, encoder, pool, chunk mode): its buckets, staging and device
    buffers, per-bucket decoders and (CUDA) graphs. Created once per pool and mode by `stepper_for`
    and kept in `pool.steppers`; the steppers of all modes share the pool (one slot serves any mode)."""

    def __init__(self, model, encoder, pool: SlotPool, graphs: bool | None = None, context_right: int | None = None) -> None:
        g = model.geometry_for(context_right)
        self.model, self.encoder, self.pool, self.g = model, encoder, pool, g
        self.mode = g.context_right
        self.device = dev = model.device
        self.cuda = dev.type == "cuda"
        self.max_rows = pool.max_step_rows
        self.sizes = bucket_sizes(self.max_rows)
        self.widths = {True: g.first_frames, False: g.chunk_frames}  # full chunk width per kind
        self.new_frames = g.encoder_frames  # encoder frames per chunk of this mode
        self.max_symbols = int(model.decoding_computer.max_symbols)
        self.out_width = self.new_frames * self.max_symbols  # tokens one step can add per row
        self.prompt = model.prompt_dictionary is not None
        b, w, f = self.max_rows, max(self.widths.values()), model.num_mels
        packed = 2 + 3 * self.out_width  # [lens | decoded | ids | frames | confidences (float32 bits)]
        self.staging = StagingSets(b, f, w, packed, self.cuda)  # host side, one set per launched part
        # Device buffers, sliced [:bucket] by every step of that bucket.
        self.d_rows = torch.full((b,), pool.scratch, dtype=torch.long, device=dev)
        self.d_lens = torch.zeros(b, dtype=torch.long, device=dev)
        self.d_langs = torch.zeros(b, dtype=torch.long, device=dev)
        self.d_feat = torch.zeros(b, f, w, dtype=torch.float32, device=dev)
        self.d_out = torch.zeros(b, packed, dtype=torch.int32, device=dev)
        # NeMo's decoder keeps its CUDA graph and hypothesis buffers in the computer object, sized
        # by the largest batch it has seen: one computer per bucket, each captured once.
        self._computers: dict[tuple[int, bool, bool], object] = {}  # (bucket, confidence, boosted)
        self._bases: dict[tuple[bool, bool], object] = {}  # (confidence, boosted) -> base computer
        self.confidence = False  # the running part's batch.confidence
        self.boosted = False  # the running part has a row with phrases
        self.parts = 0  # device steps run (a ready set over max_rows makes several)
        self.padded_rows = 0  # rows run for the scratch slot
        # graphs=False: encoder and decoder both eager (NeMo's torch_impl), the reference the GPU
        # run compares the graph path against.
        self.use_graphs = self.cuda and (graphs is None or graphs)
        # Escape hatches for a driver or NeMo build on which a graph misbehaves (the GPU run's
        # diagnosis picks them, benchmarks/gpu/diagnose.py): NEMO_SERVE_ENCODER_GRAPHS=0 runs the
        # encoder half eagerly; NEMO_SERVE_DECODER_GRAPHS=no_while_loops|off sets NeMo's decoder
        # mode (default: NeMo's choice); NEMO_SERVE_DECODER_MAX_TIME=N sizes its buffers for N
        # encoder frames instead of one chunk's.
        self.decoder_graph_mode = os.environ.get("NEMO_SERVE_DECODER_GRAPHS", "auto")
        if self.decoder_graph_mode not in ("auto", "no_while_loops", "off"):
            raise ValueError(f"NEMO_SERVE_DECODER_GRAPHS={self.decoder_graph_mode!r}: auto, no_while_loops or off")
        self.decoder_max_time = int(os.environ.get("NEMO_SERVE_DECODER_MAX_TIME", "0")) or self.new_frames
        self.graphs = None
        if self.use_graphs and os.environ.get("NEMO_SERVE_ENCODER_GRAPHS", "1") != "0":
            from .cuda_graphs import StepGraphs

            self.graphs = StepGraphs(self)
        # First call of each bucket's decoder (NeMo captures its graph then): the mode it ended in
        # and every failed attempt (`_first_decode`), for the start-up line and the GPU run.
        self.decoder_modes: dict[tuple[int, bool, bool], str] = {}
        self.decoder_failures: list[dict] = []
        self.fail_next_decoder_capture = False  # tests and the GPU run's forced-failure check
        self.gpu_times: list | None = None  # a list: (start, end) CUDA events around each device step
        self.decoder = decoder_kind(self.device)
        # Our loop's rows per joint: "all" (NeMo's shapes, bitwise NeMo's computer) or "active" (only
        # the rows that need it; a product of fewer rows may round differently: engine/label_loop.py).
        self.label_rows = os.environ.get("NEMO_SERVE_LABEL_LOOP_ROWS", "all")
        if self.label_rows not in ROW_MODES:
            raise ValueError(f"NEMO_SERVE_LABEL_LOOP_ROWS={self.label_rows!r}: one of {', '.join(ROW_MODES)}")
        self.label_trips = 0  # trips of our label loop, summed over steps (benchmarks)

    # ------------------------------------------------------------------ host side
    @property
    def host_buffers(self) -> list[torch.Tensor]:
        """Every staging buffer, owned or free (tests/test_step_sync.py tells them from device tensors)."""
        return self.staging.buffers()

    def run(self, batch: StepBatch) -> StepResult:
        """The synchronous step: launch and wait for it."""
        return self.collect(self.launch(batch))

    def launch(self, batch: StepBatch) -> LaunchedStep:
        """Stage the batch and enqueue every part's device work, all parts before any wait (on CPU
        the work is done on return). The rows' pool state belongs to the step until `collect`."""
        n = len(batch.num_frames)
        if n == 0:
            return LaunchedStep(self, [], batch.confidence)
        self.pool.flush()  # rows freed since the last step: reset in one batch, before any gather
        parts = [self._launch_part(batch, lo, hi) for lo, hi in split(n, self.max_rows)]
        return LaunchedStep(self, parts, batch.confidence)

    def collect(self, step: LaunchedStep) -> StepResult:
        """Wait for a launched step (its only wait for the device) and unpack its results; its
        staging sets are free again."""
        results = []
        for part in step.parts:
            if part.done is not None:
                part.done.synchronize()
            results.append(self._unpack(part.staging.out[: part.num_rows].numpy(), part.confidence))
            self.staging.give_back(part.staging)
        if len(results) == 1:
            return results[0]
        return StepResult(
            [r for p in results for r in p.token_ids],
            [r for p in results for r in p.token_frames],
            [r for p in results for r in p.decoded_frames],
            [r for p in results for r in p.token_confidences] if step.confidence else None,
        )

    def _launch_part(self, batch: StepBatch, lo: int, hi: int) -> LaunchedPart:
        n = hi - lo
        bucket = bucket_for(n, self.sizes)
        width = self.widths[batch.is_first]
        num_frames = batch.num_frames[lo:hi]
        if max(num_frames) > width or batch.features.shape[-1] > width:
            raise ValueError(f"chunk wider than the mode's {width} frames")
        full = min(num_frames) == width
        self.parts += 1
        self.padded_rows += bucket - n
        self.confidence = batch.confidence
        self.boosted = self.pool.biasing is not None and self.pool.any_boosted(batch.rows[lo:hi])
        st = self.staging.take()
        stage_rows(st, self.d_rows, batch.rows, lo, hi, bucket, self.pool.scratch, self.device, self.cuda)
        st.lens[:n] = torch.as_tensor(num_frames, dtype=torch.long)
        st.lens[n:bucket] = width  # padded rows: full width (the unmasked path stays open)
        self.d_lens[:bucket].copy_(st.lens[:bucket], non_blocking=self.cuda)
        if self.prompt:
            stage_languages(st, self.d_langs, batch.languages, lo, hi, bucket, self.d_rows, self.pool.languages,
                            self.device, self.cuda)  # fmt: skip
        stage_features(st, self.d_feat, batch.features, lo, hi, width, self.device)
        events = None
        if self.gpu_times is not None and self.cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        if self.graphs is not None:
            self.graphs.run(bucket, batch.is_first, full)
        else:
            self.device_step(bucket, batch.is_first, full)
        if events is not None:
            events[1].record()
            self.gpu_times.append(events)  # read after collect: both have completed by then
        # The packed results of the real rows, int32, into the part's own staging; `collect` waits.
        st.out[:n].copy_(self.d_out[:n], non_blocking=self.cuda)
        done = None
        if self.device.type == "cuda":  # the device itself (a test sets `cuda` to take the CUDA code paths on a CPU)
            done = torch.cuda.Event()
            done.record()
        return LaunchedPart(st, n, batch.confidence, done)

    def _unpack(self, out: np.ndarray, confidence: bool) -> StepResult:
        k = self.out_width
        lens = out[:, 0]
        used = int(lens.max(initial=0))
        ids = out[:, 2 : 2 + used].tolist()
        frames = out[:, 2 + k : 2 + k + used].tolist()
        lens = lens.tolist()
        confidences = None
        if confidence:  # float32 bits, written by `decode`
            c = out[:, 2 + 2 * k : 2 + 2 * k + used].view(np.float32).clip(0.0, 1.0).tolist()
            confidences = [r[:m] for r, m in zip(c, lens)]
        return StepResult(
            token_ids=[r[:m] for r, m in zip(ids, lens)],
            token_frames=[r[:m] for r, m in zip(frames, lens)],
            decoded_frames=out[:, 1].tolist(),
            token_confidences=confidences,
        )

    # ------------------------------------------------------------------ device side
    def device_step(self, bucket: int, is_first: bool, full: bool) -> None:
        """Everything between the staged inputs and the packed results, at static shapes: reads
        d_rows/d_lens/d_langs/d_feat[:bucket], writes the pool's rows and d_out[:bucket]. No host
        sync outside the decoder (NeMo's CUDA-graph decoder has none)."""
        encoded, encoded_len = self.encode(bucket, is_first, full)
        self.decode(bucket, encoded, encoded_len)

    def encode(self, bucket: int, is_first: bool, full: bool):
        model, pool, g = self.model, self.pool, self.g
        rows = self.d_rows[:bucket]
        features = self.d_feat[:bucket, :, : self.widths[is_first]]
        # 1. input: [history | new frames] for later chunks, new frames alone for first chunks.
        history = pool.gather_history(rows)  # [B, F, 9]
        with_history = torch.cat([history, features], dim=-1)
        pool.scatter_history(rows, with_history[:, :, -g.pre_cache_frames :])  # only used if the chunk was full
        if is_first:
            signal, drop, lengths = features, 0, self.d_lens[:bucket]
        else:
            signal, drop, lengths = with_history, g.drop_frames, self.d_lens[:bucket] + g.pre_cache_frames
        # 2. encoder: caches read and written in the slot rows (ring layout, engine/ring_cache.py),
        # or gathered from and written back to them (window layout, the reference).
        if pool.layout == "ring":  # a plain SlotPool keeps the window path, whichever KV encoder
            encoded, encoded_len = self.encoder.step_in_place(
                signal.to(model.dtype), lengths, pool, rows, drop, full, context_right=self.mode
            )
        else:
            encoded, encoded_len, cache = self.encoder.step(
                signal.to(model.dtype), lengths, pool.gather_encoder(rows), drop, full, context_right=self.mode
            )
            pool.scatter_encoder(rows, cache)
        if self.prompt:
            encoded = apply_prompt(model, encoded, self.d_langs[:bucket])
        # Padded rows decode nothing: length 0 (what NeMo's graph decoder gives its padding).
        encoded_len = torch.where(rows == pool.scratch, 0, encoded_len)
        return encoded, encoded_len

    def decode(self, bucket: int, encoded: torch.Tensor, encoded_len: torch.Tensor) -> None:
        pool, rows = self.pool, self.d_rows[:bucket]
        # 3. RNN-T greedy label-looping decoding from the rows' carried state.
        state = pool.gather_decoder(rows, self.boosted)
        bias = {"multi_biasing_ids": pool.biasing_ids.index_select(0, rows)} if self.boosted else {}
        key = (bucket, self.confidence, self.boosted)
        with aten_rnn(encoded.device, encoded.dtype):
            if self.decoder == "label_loop":
                hyps, new_state = label_loop(self._base(), encoded.transpose(1, 2), encoded_len, state,
                                             bias.get("multi_biasing_ids"), self.confidence, self.label_rows)  # fmt: skip
                self.label_trips += hyps.trips
            elif key in self.decoder_modes:
                hyps, new_state = self.computer(bucket)(
                    x=encoded.transpose(1, 2), out_len=encoded_len, prev_batched_state=state, **bias
                )
            else:
                hyps, new_state = self._first_decode(key, encoded, encoded_len, state, bias)
        pool.scatter_decoder(rows, new_state)
        # 4. results packed as int32 at the width a step can fill: [lens | decoded | ids | frames].
        out, k = self.d_out[:bucket], self.out_width
        m = min(k, hyps.transcript.shape[1])
        out[:, 0].copy_(hyps.current_lengths[:bucket])
        out[:, 1].copy_(new_state.decoded_lengths[:bucket])
        out[:, 2 : 2 + m].copy_(hyps.transcript[:bucket, :m])
        out[:, 2 + k : 2 + k + m].copy_(hyps.timestamps[:bucket, :m])
        if self.confidence:
            out[:, 2 + 2 * k : 2 + 2 * k + m].view(torch.float32).copy_(hyps.step_confidence[:bucket, :m])

    def report(self) -> dict:
        """What the graphs came to: encoder keys captured and failed (with the exception), the mode
        each bucket's decoder ended in, and every failed decoder attempt."""
        g = self.graphs
        return {
            "settings": {"decoder": decoder_name(self.device),
                         "decoder_graphs": self.decoder_graph_mode if self.use_graphs else "off",
                         "decoder_max_time": self.decoder_max_time},  # fmt: skip
            "graphs": g is not None,
            "encoder_captured": sorted(map(list, g.graphs)) if g is not None else [],
            "encoder_failed": {str(list(k)): v for k, v in sorted(g.failed.items())} if g is not None else {},
            "decoder_modes": {f"{b}{'+conf' if c else ''}{'+boost' if x else ''}": m
                              for (b, c, x), m in sorted(self.decoder_modes.items())},  # fmt: skip
            "decoder_failures": list(self.decoder_failures),
            # encoder frames NeMo's buffers hold per bucket: new_frames, unless an input forced a re-size
            "decoder_max_time": {f"{b}{'+conf' if conf else ''}{'+boost' if x else ''}": c.state.max_time
                                 for (b, conf, x), c in sorted(self._computers.items()) if c.state is not None},
        }

    def prepare(self, buckets: list[int] | None = None, confidence: bool = False) -> None:
        """Run every (bucket, first/later, full/short) once on scratch rows only: captures the
        CUDA graphs (ours and NeMo's decoder per bucket) at start-up. Nothing a stream holds is
        touched (all rows point at the scratch slot). Cheap to skip on CPU."""
        self.confidence = confidence  # which decoder computers to capture (module docstring)
        with torch.inference_mode():
            self._prepare(buckets)

    def _prepare(self, buckets: list[int] | None) -> None:
        for bucket in buckets or self.sizes:
            self.d_rows[:bucket].fill_(self.pool.scratch)
            for is_first in (True, False):
                self.d_lens[:bucket].fill_(self.widths[is_first])
                for full in (True, False):
                    if self.graphs is not None:
                        self.graphs.run(bucket, is_first, full)
                    else:
                        self.device_step(bucket, is_first, full)
        if self.cuda:
            torch.cuda.synchronize()


def stepper_for(model, encoder, pool: SlotPool, context_right: int | None = None) -> Stepper:
    """The pool's stepper for one mode (None: the default), created on first use (`pool.steppers`)."""
    mode = model.geometry_for(context_right).context_right
    s = pool.steppers.get(mode)
    if s is None or s.encoder is not encoder or s.model is not model:
        s = pool.steppers[mode] = Stepper(model, encoder, pool, context_right=mode)
    return s


def prepare_step(
    model, encoder, pool: SlotPool, buckets: list[int] | None = None, confidence: bool = False
) -> list[Stepper]:
    """Start-up: build the pool's stepper of every served mode and, on CUDA, capture every
    bucket's graphs now (`confidence`: the decoders with token confidence, as the engine runs)."""
    steppers = [stepper_for(model, encoder, pool, mode) for mode in model.modes]
    for s in steppers:
        if s.cuda:
            s.prepare(buckets, confidence)
    return steppers


@torch.inference_mode()
def run_step(model, encoder, pool: SlotPool, batch: StepBatch) -> StepResult:
    """`encoder`: a NemoEncoder or KVCacheEncoder whose cache layout matches `pool`."""
    return stepper_for(model, encoder, pool, batch.context_right).run(batch)


@torch.inference_mode()
def launch_step(model, encoder, pool: SlotPool, batch: StepBatch) -> LaunchedStep:
    """`run_step`'s first half: staged and enqueued, not waited for (`collect_step`)."""
    return stepper_for(model, encoder, pool, batch.context_right).launch(batch)


def collect_step(step: LaunchedStep) -> StepResult:
    """`run_step`'s second half: the launched step's results, after its one wait for the device."""
    return step.stepper.collect(step)

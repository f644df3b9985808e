"""CUDA graphs of the bucketed step (CUDA only; never imported on CPU).

Per (bucket, first/later chunk, full/short final chunk) the encoder half of `Stepper.device_step`
is captured once and replayed: feature history, the gathered caches, every encoder layer, the
cache write-back, the prompt and the padded rows' zero lengths. Its inputs are the stepper's
persistent device buffers sliced to the bucket, its outputs (encoded frames and lengths) are
static tensors of the graph, consumed at once by the decoder half.

With NEMO_SERVE_DECODER=label_loop (engine/label_loop.py) the decoder half is our loop, eager after
the encoder graph's replay (one host sync per label trip; not captured yet). Otherwise (CUDA's
default) the decoder half runs NeMo's label-looping computer in its own CUDA-graph mode, one computer per
bucket (`Stepper.computer`) whose graph NeMo captures on that bucket's first call (at start-up
with `Stepper.prepare`). It cannot sit inside our capture: NeMo replays its graph with a
cudaGraphLaunch and clones its outputs, neither of which stream capture records. Around it,
gathering and scattering the decoder state and packing the results are ~15 eager launches.

All graphs share one memory pool. That is safe here because a graph's outputs are read right after
its own replay, before any other graph runs, and graphs never run concurrently (one step loop).

A capture that fails falls back to the eager step for that key: the device is waited for and the
default stream made current again, the exception is logged with its traceback and kept in `failed`
(Stepper.report, the start-up line and the GPU run's `validate` record show it).
"""

from __future__ import annotations

import logging

import torch

from .device_state import restore_device_state

log = logging.getLogger(__name__)


class StepGraphs:
    def __init__(self, stepper, warmup_iters: int = 2) -> None:
        self.s = stepper
        self.warmup_iters = warmup_iters
        self.mempool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, bool, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.failed: dict[tuple[int, bool, bool], str] = {}  # key -> the capture's exception
        self.fail_next_capture = False  # tests and the GPU run's forced-failure check

    def run(self, bucket: int, is_first: bool, full: bool) -> None:
        key = (bucket, is_first, full)
        entry = self.graphs.get(key)
        if entry is None and key not in self.failed:
            entry = self._capture(key)
        if entry is None:
            self.s.device_step(bucket, is_first, full)
            return
        graph, encoded, encoded_len = entry
        graph.replay()
        self.s.decode(bucket, encoded, encoded_len)

    def _capture(self, key):
        """Warm up and capture with every row pointed at the scratch slot, so neither the warm-up
        runs nor the capture touch a stream's state; the staged rows are put back afterwards."""
        s = self.s
        bucket = key[0]
        saved = s.d_rows[:bucket].clone()
        s.d_rows[:bucket].fill_(s.pool.scratch)
        try:
            if self.fail_next_capture:
                self.fail_next_capture = False
                raise RuntimeError("forced capture failure (fail_next_capture)")
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(self.warmup_iters):  # lazy caches (positions), cuBLAS/cuDNN workspaces
                    s.encode(*key)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
                encoded, encoded_len = s.encode(*key)
            self.graphs[key] = (graph, encoded, encoded_len)
            return self.graphs[key]
        except Exception as e:  # noqa: BLE001 - a step that cannot be captured still runs eagerly
            restore_device_state(s.device)
            log.warning("CUDA graph capture failed for bucket %d first=%s full=%s; running it eagerly", *key,
                        exc_info=True)  # fmt: skip
            self.failed[key] = f"{type(e).__name__}: {e}"[:500]
            return None
        finally:
            s.d_rows[:bucket].copy_(saved)

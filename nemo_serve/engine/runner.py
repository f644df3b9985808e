"""The model-runner interface: one model family in the engine core's loop.

A runner owns what a slot holds for its model (cache rows, speaker caches), runs one batched step
over the rows it is given and returns each row's results. The engine's loop (engine/loop.py) owns
the streams, decides which rows step and publishes; it reaches a model only through a runner, so
a second model family is a new runner, not edits in the slot pool, the stepper and the loop.

Two runners today, both driven by `Engine.iterate()` on the same device, each with its own slots,
chunking and step:
- `RnntRunner` (here): the cache-aware RNN-T. It wraps, does not rewrite, the stepper
  (engine/step.py launch_step / collect_step) and the slot pool (engine/slots.py); its chunking is
  the engine's scheduler (engine/scheduler.py), which plans the groups it is handed.
- `SortformerRunner` (diarization/runner.py): streaming Sortformer for the streams that asked for
  speakers; it plans its own chunks (NeMo's streaming_feat_loader grid) from its own copy of the
  audio.
"""

from __future__ import annotations

from typing import Any, Protocol

from .step import StepBatch, StepResult, collect_step, launch_step


class ModelRunner(Protocol):
    """What the loop needs of a model family. `launch` enqueues a batched step on the device and
    returns at once (its staging belongs to the launched step); `collect` waits for it and returns
    the rows' results in the batch's order."""

    def open_row(self, slot: int, **row: Any) -> None: ...

    def close_row(self, slot: int) -> None: ...

    def launch(self, batch: Any) -> Any: ...

    def collect(self, launched: Any) -> Any: ...


class RnntRunner:
    """The cache-aware RNN-T: encoder caches and decoder state in the slot pool's rows."""

    def __init__(self, model, encoder, pool) -> None:
        self.model, self.encoder, self.pool = model, encoder, pool

    def open_row(self, slot: int, *, language_index: int, biasing_id: int, tree_state: int) -> None:
        self.pool.open_row(slot, language_index, biasing_id, tree_state)

    def close_row(self, slot: int) -> None:
        self.pool.close_row(slot)

    def launch(self, batch: StepBatch):
        return launch_step(self.model, self.encoder, self.pool, batch)

    def collect(self, launched) -> StepResult:
        return collect_step(launched)

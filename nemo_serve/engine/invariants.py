"""Slot accounting invariants, checked at every loop iteration when the tests ask for it.

Set NEMO_SERVE_CHECK_INVARIANTS to a directory and every step loop (the engine core's, or the
in-process harness's loop thread) checks after each iteration that its books agree:

  the slot table (engine/slot_table.py, the one record of which streams are open) holds each open
  stream under its own slot and id; each open slot's scheduler row is in its stream's chunk mode;
  the boosted cache rows are those of streams with phrases and the phrase count is theirs; and
  every slot the engine holds is allocated by whoever drives it to that stream: in an engine core,
  owned in the shared-memory slot table by the front end that opened it, at its generation; in
  process, allocated by the harness to that stream id

(engine/accounting.py Engine.check_accounting, core/engine_core.py EngineCore.check_invariants,
core/inproc.py LocalEngine.check_accounting). Any drift raises AccountingError on the loop,
which fails the engine loudly (an engine core exits FAILED; the in-process harness's loop sets
LocalEngine.error, and a server around it fails every stream).
Each loop also appends, whenever it changes, the number of streams holding a cache row to
DIR/<name>-<pid>.tsv ("unix time<TAB>rows"): tests read the engine side's count from there.

Off by default (unset or empty): the checks walk every open stream, which a server at
thousands of streams should not pay for at every iteration.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "NEMO_SERVE_CHECK_INVARIANTS"


class AccountingError(AssertionError):
    """The engine's stream, slot or cache-row books disagree, or hold more than num_slots."""


class InvariantLog:
    """The count of streams holding a cache row, one line per change, into DIR/<name>-<pid>.tsv."""

    def __init__(self, directory: str | os.PathLike, name: str) -> None:
        self.path = Path(directory) / f"{name}-{os.getpid()}.tsv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - held for the process's life
        self._last: int | None = None

    def record(self, rows: int) -> None:
        if rows != self._last:
            self._last = rows
            self._file.write(f"{time.time():.6f}\t{rows}\n")


def from_env(name: str) -> InvariantLog | None:
    """The log for this loop if NEMO_SERVE_CHECK_INVARIANTS names a directory, else None (off)."""
    directory = os.environ.get(ENV)
    return InvariantLog(directory, name) if directory else None


def check(condition: bool, what: str) -> None:
    if not condition:
        raise AccountingError(f"slot accounting drifted: {what}")

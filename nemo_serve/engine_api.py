"""The engine interface the server is written against: declared here, implemented twice.

  core/inproc.py LocalEngine     in process: the engine core class on a thread (tests, --selftest, benchmarks)
  core/group.py EngineGroup      the engine-core processes (one or several, one per device), reached
                                 through shared memory and a control channel; a group of one core
                                 when there is one core, so no caller asks which kind it holds

Servers run the group (compose.py); the in-process engine stands in for it in tests. Server code
(server/*, the front ends) uses only these members and never tests for others (no hasattr): a
member added here must exist in both, and tests/test_engine_api.py checks that it does. Torch-free, as every front end is.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, TypedDict

import numpy as np

from .engine.endpoint import EndpointConfig
from .engine.geometry import ModelInfo
from .engine.results import StreamResult
from .admission import Verdict


class CoreStatus(TypedDict):
    """One engine core as /readyz and /metrics show it."""

    core: int
    device: str
    pid: int
    serving: bool
    free_slots: int
    total_slots: int
    open_streams: int
    queue_delay_s: float
    recovering_cap: int | None  # its overload guard's cap (admission.py); None: its slots alone


class EngineAPI(Protocol):
    """Streams in, results out. Called from the server's event loop thread only.

    A stream's handle is what `open_stream` returned; it is opaque to the caller. Results reach
    `on_result` (on the event loop for the engine cores, on the step loop thread in the in-process
    harness: the sessions hand them to their loop with call_soon_threadsafe either way)."""

    model_info: ModelInfo  # what the network side knows of the model: geometry, vocabulary, modes

    # ------------------------------------------------------------------ lifecycle
    @property
    def started(self) -> bool: ...

    def start(self) -> Any: ...

    def stop(self, timeout_s: float = ...) -> None: ...

    @property
    def error(self) -> BaseException | None:
        """None while the engine serves (a group: while any of its cores does)."""
        ...

    # ------------------------------------------------------------------ streams
    def open_stream(
        self,
        on_result: Callable[[StreamResult], None],
        *,
        stream_id: str | None = None,
        language: str | None = None,
        endpoint: EndpointConfig | None = None,
        context_right: int | None = None,
        phrases: list[str] | None = None,
        boost: float | None = None,
        diarization: dict | None = None,
    ) -> Any:
        """A handle, or NoFreeSlotError / ValueError (bad language, mode or phrases)."""
        ...

    def push(self, handle: Any, samples: np.ndarray, arrived: float | None = None) -> None: ...

    def finish(self, handle: Any) -> None: ...

    def force_final(self, handle: Any, at_sample: int | None = None) -> None:
        """Close the stream's segment now; `at_sample` (samples since the stream opened, at the
        model's rate): right after the whole chunks before it are decoded, wherever the engine is
        now (engine/forced_ends.py). Send it before the audio past that sample."""
        ...

    def abort(self, handle: Any, reason: str = ...) -> None: ...

    # ------------------------------------------------------------------ load (admission, /readyz, /metrics)
    @property
    def num_slots(self) -> int: ...

    @property
    def num_free_slots(self) -> int: ...

    @property
    def num_open_streams(self) -> int: ...

    @property
    def queue_delay_s(self) -> float: ...

    def open_by_mode(self) -> dict[int, int]: ...

    def overload(self, decide: bool = False, now: float | None = None) -> Verdict:
        """Whether a new stream is refused for overload (admission.py: one guard per engine
        core, on that core's numbers; a group refuses when no core with a free slot admits).
        `decide`: for a stream being admitted or refused now, which moves the guards; else reads
        only (/readyz). `now` (default: the clock): the time judged at; one /readyz answer
        passes the same to `cores`, so the caps it shows agree (a cap grows with time)."""
        ...

    def cores(self, now: float | None = None) -> list[CoreStatus]: ...


def interface_members() -> set[str]:
    """The names an implementation must have (tests/test_engine_api.py)."""
    own = set(EngineAPI.__dict__) | set(EngineAPI.__annotations__)
    return {n for n in own if not n.startswith("_")}

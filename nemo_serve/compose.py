"""The composition root: settings in, engine and server out. Every way nemo-serve runs builds
them here, so a setting reaches the engine the same way everywhere:

  core/engine_core.py                 load_engine (the engine an engine-core process drives)
  core/frontend_process.py            frontend_context (the group of engine cores a front end talks to)
  ray_serve.py                        frontend_context, on cores the replica starts (core/core_set.py)
  tests, --selftest, benchmarks       in_process_engine (the engine behind core/inproc.py), server_context

Torch is imported only by the functions that build an engine (a front end never calls them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import Settings
from .engine_api import EngineAPI
from .server.context import ServerContext
from .server.metrics import ServerMetrics

if TYPE_CHECKING:
    from .engine.geometry import ModelInfo
    from .core.inproc import LocalEngine
    from .engine.loop import Engine


def engine_for(model, settings: Settings) -> "Engine":
    """The engine for a loaded model, with every engine setting from `settings`: single-threaded,
    for its owner to drive (an engine core, or the in-process harness)."""
    from .engine.loop import Engine

    return Engine(
        model,
        num_slots=settings.num_slots,
        max_batch=settings.max_batch,
        endpoint=settings.endpoint_config,
        kv_cache=settings.kv_cache,
        token_confidence=settings.word_confidence,
        phrase_limits=settings.phrase_limits,
        diarizer=_diarizer(settings, model.device),
    )


def _diarizer(settings: Settings, device):
    if settings.diarizer is None:
        return None
    from .diarization.load import load_diarizer

    return load_diarizer(settings.diarizer, str(device))


def load_engine(settings: Settings, device: str | None = None) -> "Engine":
    """Load the model the settings name on `device` (default: settings.device) and build its
    engine, CUDA graphs captured before any traffic. Raises model.ModelLoadError,
    UnsupportedModeError, FileNotFoundError or ValueError for what the user can fix."""
    from .model import load_model

    model = load_model(settings.model, context_right=settings.context_right, dtype=settings.dtype,
                       device=device or settings.device)  # fmt: skip
    engine = engine_for(model, settings)
    engine.prepare()  # CUDA: every graph captured now, not during traffic (logs one line)
    return engine


def in_process_engine(model, settings: Settings) -> "LocalEngine":
    """engine_for's engine behind the in-process EngineAPI (core/inproc.py)."""
    from .core.inproc import LocalEngine

    return LocalEngine(engine_for(model, settings), max_queue_delay_s=settings.max_queue_delay_s)


def server_context(engine: EngineAPI, settings: Settings) -> ServerContext:
    """What every socket shares. The step histograms are not here: the engine cores observe them
    (PROMETHEUS_MULTIPROC_DIR)."""
    metrics = ServerMetrics(engine.num_slots, lambda: engine.num_free_slots, cores_fn=engine.cores,
                            queue_delay_fn=lambda: engine.queue_delay_s)  # fmt: skip
    return ServerContext(engine=engine, settings=settings, metrics=metrics)


def frontend_engine(settings: Settings, info: "ModelInfo", cores: list, frontend: int) -> EngineAPI:
    """Front end `frontend`'s handle on the engine cores (`cores`: core/frontend_process.py's
    CoreEndpoint, one per core): always a group, of one core or several."""
    from .core.client import EngineClient
    from .core.group import EngineGroup
    from .core.shared import SharedSlots

    clients = [EngineClient(info, SharedSlots.attach(c.shm_name, c.layout, c.lock), frontend, c.ipc_dir,
                            phrase_limits=settings.phrase_limits, max_queue_delay_s=settings.max_queue_delay_s)
               for c in cores]  # fmt: skip
    return EngineGroup(clients, cores)


def frontend_context(settings: Settings, info: "ModelInfo", cores: list, frontend: int) -> ServerContext:
    return server_context(frontend_engine(settings, info, cores, frontend), settings)

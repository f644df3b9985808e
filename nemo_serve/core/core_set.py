"""The engine-core processes of one server, from spawn to stop: used by the supervisor (the
`nemo-serve` process) and by a Ray Serve replica, which both run the same cores.

  start   spawn one core per device (--devices; one on --device by default); each loads the
          model and reports its ModelInfo (or a load error); then create each core's shared
          memory (slot table, audio rings) now that the sample rate is known, and connect a
          control socket to each (the supervisor's messages: front end gone, stop)
  stop    a Stop to each live core, then join; a core that does not stop in time is killed
  close   sockets and shared memory (the creator unlinks it)
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from typing import Callable

import zmq

from . import messages as m
from .addresses import control_address
from .core_proc import run_core_process
from .engine_core import ring_layout
from .frontend_process import CoreEndpoint
from .shared import FAILED, FileLock, SharedSlots

log = logging.getLogger("nemo_serve.supervisor")

CORE_STOP_TIMEOUT_S = 10.0


class CoreStartError(RuntimeError):
    """A core did not start. `status`: 2 for what the user can fix (the model would not load:
    the message says why), 1 otherwise."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Core:
    """One engine-core process and what its parent keeps of it."""

    def __init__(self, index: int, device: str, ipc_dir: str) -> None:
        self.index, self.device, self.ipc_dir = index, device, ipc_dir
        os.makedirs(ipc_dir)
        self.lock = FileLock(os.path.join(ipc_dir, "slots.lock"))
        self.process: mp.Process | None = None
        self.conn = None  # the pipe's parent end, during start-up
        self.shared: SharedSlots | None = None
        self.control = None  # zmq PUSH to the core's control socket
        self.dead = False

    @property
    def alive(self) -> bool:
        return not self.dead and self.process is not None and self.process.is_alive()

    def endpoint(self) -> CoreEndpoint:
        """What a front end needs to reach this core (picklable)."""
        return CoreEndpoint(self.index, self.device, self.shared.name, self.shared.layout, self.lock, self.ipc_dir,
                            self.process.pid)  # fmt: skip


class CoreSet:
    def __init__(self, settings, ipc_dir: str, interrupted: Callable[[], bool] = lambda: False) -> None:
        """`interrupted`: polled while waiting for a core's report (the supervisor's signals)."""
        self.settings = settings
        self.ipc_dir = ipc_dir
        self.interrupted = interrupted
        self.mp = mp.get_context("spawn")
        self.cores: list[Core] = []
        self.info = None  # the ModelInfo every core reported, once started
        self._zmq = zmq.Context()

    def start(self) -> None:
        """Every core serving, or CoreStartError (the cores started so far are left to stop())."""
        try:
            devices = self.settings.device_list()
        except ValueError as e:
            raise CoreStartError(2, str(e)) from None
        for i, device in enumerate(devices):  # every core first: they load the model in parallel
            core = Core(i, device, os.path.join(self.ipc_dir, f"core{i}"))
            core.conn, child = self.mp.Pipe()
            core.process = self.mp.Process(
                target=run_core_process,
                args=(self.settings.model_copy(update={"device": device}), core.ipc_dir, core.lock, child, os.getpid()),
                name=f"nemo-serve-core-{i}", daemon=False,
            )  # fmt: skip
            core.process.start()
            self.cores.append(core)
        for core in self.cores:
            kind, core_info = self._recv(core)
            if kind == "error":
                raise CoreStartError(2, core_info)
            if kind != "ready":
                raise CoreStartError(1, f"engine core {core.index} did not start ({kind} {core_info})")
            self.info = self.info or core_info
            layout = ring_layout(self.settings, core_info.geometry.sample_rate)
            core.shared = SharedSlots.create(layout, core.lock)
            core.conn.send((core.shared.name, layout))
        for core in self.cores:
            kind, detail = self._recv(core)
            if kind != "serving":
                raise CoreStartError(1, f"engine core {core.index} did not start serving ({kind} {detail})")
            core.control = self._zmq.socket(zmq.PUSH)
            core.control.setsockopt(zmq.LINGER, 1000)
            core.control.connect(control_address(core.ipc_dir))

    def _recv(self, core: Core):
        """The core's next report; ("died", exitcode) if it exits first."""
        while not core.conn.poll(0.2):
            if not core.process.is_alive():
                return "died", core.process.exitcode
            if self.interrupted():
                return "signal", None
        return core.conn.recv()

    def endpoints(self) -> list[CoreEndpoint]:
        return [c.endpoint() for c in self.cores]

    def tell(self, msg) -> None:
        """A control message to every live core."""
        for core in self.cores:
            if core.alive and core.control is not None:
                core.control.send(m.control_encoder.encode(msg))

    def stop(self, timeout_s: float = CORE_STOP_TIMEOUT_S) -> None:
        alive = [c for c in self.cores if c.alive]
        self.tell(m.Stop())
        deadline = time.monotonic() + timeout_s
        for core in alive:
            core.process.join(max(0.0, deadline - time.monotonic()))
            if core.process.is_alive():
                core.process.kill()

    def watch(self, stopped: threading.Event, period_s: float = 0.5) -> None:
        """For a parent with no watch loop of its own (a Ray replica), on a thread until `stopped`:
        a core that dies is marked FAILED in its shared memory, so the front end fails its streams
        with an error and /readyz answers 503 once none serves (the supervisor's _core_died)."""
        while not stopped.wait(period_s):
            for core in self.cores:
                if not core.dead and core.process is not None and not core.process.is_alive():
                    core.dead = True
                    core.shared.state[0] = FAILED
                    log.error("engine core %d on %s (pid %d) died with exit code %s", core.index, core.device,
                              core.process.pid, core.process.exitcode)  # fmt: skip

    def kill(self) -> None:
        for core in self.cores:
            if core.process is not None and core.process.is_alive():
                core.process.kill()

    def close(self) -> None:
        """After stop() or kill(): sockets, then shared memory."""
        for core in self.cores:
            if core.process is not None:
                core.process.join(1.0)
            if core.control is not None:
                core.control.close(0)
        self._zmq.term()
        for core in self.cores:
            if core.shared is not None:
                core.shared.close()

"""The supervisor: the `nemo-serve` process itself when it runs several processes.

  1 spawn the engine core; it loads the model and reports its ModelInfo (or a load error: exit 2)
  2 create the shared memory (slot table, audio rings) now that the sample rate is known
  3 spawn K front ends on one port (SO_REUSEPORT); the port is reserved here first, so
    --port 0 gives every front end the same free port
  4 watch: a front end that dies has its streams aborted and its slots freed in the core, and
    is replaced; a core that dies is marked FAILED in shared memory (the front ends fail their
    streams with an error and answer /readyz 503), then everything stops and the exit status
    is 1, for the process supervisor (systemd, Kubernetes) to restart the server
  5 SIGTERM or Ctrl-C: each front end drains (every open stream gets its final), then the core
    stops; exit 0. A second signal stops everything at once.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time

import zmq

from . import messages as m
from .engine_core import control_address, ring_layout, run_core_process
from .frontend_process import bind_reuseport, run_frontend_process
from .shared import FAILED, FileLock, SharedSlots

log = logging.getLogger("nemo_serve.supervisor")

MAX_RESTARTS_PER_MINUTE = 10
CORE_STOP_TIMEOUT_S = 10.0


def default_frontends(cpu_count: int | None = None) -> int:
    """One core for the engine, about two per front end (its event loop plus the kernel's
    network work), at least one, at most eight."""
    n = cpu_count or os.cpu_count() or 1
    return max(1, min(8, (n - 1) // 2))


class Supervisor:
    def __init__(self, settings, frontends: int) -> None:
        self.settings = settings
        self.num_frontends = frontends
        self.mp = mp.get_context("spawn")
        self.ipc_dir = tempfile.mkdtemp(prefix="nemo-serve-")
        self.metrics_dir = os.path.join(self.ipc_dir, "metrics")
        os.makedirs(self.metrics_dir)
        self.lock = FileLock(os.path.join(self.ipc_dir, "slots.lock"))
        self.core: mp.Process | None = None
        self.frontends: dict[int, mp.Process] = {}  # front-end id -> process
        self._next_id = 0
        self._deaths: list[float] = []
        self._signals = 0
        self.shared: SharedSlots | None = None
        self._port_socket = None
        self._zmq = zmq.Context()
        self._control = None

    # ------------------------------------------------------------------ main
    def run(self) -> int:
        previous = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir  # inherited by every child
        handlers = signal.signal(signal.SIGTERM, self._on_signal), signal.signal(signal.SIGINT, self._on_signal)
        try:
            return self._run()
        finally:
            self._cleanup()
            # the directory is gone: a caller that goes on in this process (cli.main in a test) must
            # not find prometheus-client pointed at it
            if previous is None:
                os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous
            signal.signal(signal.SIGTERM, handlers[0])
            signal.signal(signal.SIGINT, handlers[1])

    def _run(self) -> int:
        parent, child = self.mp.Pipe()
        self.core = self.mp.Process(
            target=run_core_process, args=(self.settings, self.ipc_dir, self.lock, child, os.getpid()),
            name="nemo-serve-core", daemon=False,
        )  # fmt: skip
        self.core.start()
        kind, info = self._recv(parent)
        if kind == "error":  # as the one-process server: one line, status 2
            print(f"nemo-serve: error: {info}", file=sys.stderr, flush=True)
            return 2
        if kind != "ready":
            log.error("engine core did not start (%s %s)", kind, info)
            return 1
        layout = ring_layout(self.settings, info.geometry.sample_rate)
        self.shared = SharedSlots.create(layout, self.lock)
        parent.send((self.shared.name, layout))
        kind, _ = self._recv(parent)
        if kind != "serving":
            return 1
        self._control = self._zmq.socket(zmq.PUSH)
        self._control.setsockopt(zmq.LINGER, 1000)
        self._control.connect(control_address(self.ipc_dir))
        self.info = info
        self.port = self._reserve_port()
        print(info.summary, flush=True)
        ring_mib = layout.nbytes / 2**20
        print(f"engine core pid {self.core.pid}; {self.num_frontends} front-end processes on port {self.port}; "
              f"shared memory {ring_mib:.1f} MiB ({self.settings.audio_ring_s:g} s audio ring per slot)", flush=True)  # fmt: skip
        for _ in range(self.num_frontends):
            self._start_frontend()
        from ..cli import _print_urls

        _print_urls(self.settings, self.port)
        return self._watch()

    def _recv(self, conn):
        """The core's next report; ("died", exitcode) if it exits first."""
        while not conn.poll(0.2):
            if not self.core.is_alive():
                return "died", self.core.exitcode
            if self._signals:
                return "signal", None
        return conn.recv()

    def _reserve_port(self) -> int:
        """Bind (not listen) a SO_REUSEPORT socket: it fixes the port (for --port 0 too) and
        keeps it ours between front-end restarts; only listening sockets get connections."""
        self._port_socket = bind_reuseport(self.settings.host, self.settings.port)
        return self._port_socket.getsockname()[1]

    def _start_frontend(self) -> None:
        fid, self._next_id = self._next_id, self._next_id + 1
        p = self.mp.Process(
            target=run_frontend_process,
            args=(self.settings, self.info, self.shared.name, self.shared.layout, self.lock, self.ipc_dir, fid, self.port,
                  self.num_frontends),
            name=f"nemo-serve-frontend-{fid}",
            daemon=False,
        )
        p.start()
        self.frontends[fid] = p

    # ------------------------------------------------------------------ watch
    def _watch(self) -> int:
        draining = False
        while True:
            if self._signals and not draining:
                draining = True
                log.info("draining %d front ends (send the signal again to quit at once)", len(self.frontends))
                for p in self.frontends.values():
                    _signal(p, signal.SIGTERM)
            if self._signals > 1:
                log.warning("second signal: stopping now")
                self._kill_all()
                return 1
            sentinels = [self.core.sentinel] + [p.sentinel for p in self.frontends.values()]
            multiprocessing.connection.wait(sentinels, timeout=0.5)
            if not self.core.is_alive():
                return self._core_died()
            for fid, p in list(self.frontends.items()):
                if p.is_alive():
                    continue
                del self.frontends[fid]
                self._mark_dead(p.pid)
                self._tell_core(m.FrontendGone(fid))
                if draining:
                    continue
                log.error("front end %d (pid %d) exited with %s; starting another", fid, p.pid, p.exitcode)
                now = time.monotonic()
                self._deaths = [t for t in self._deaths if now - t < 60] + [now]
                if len(self._deaths) > MAX_RESTARTS_PER_MINUTE:
                    log.error("front ends keep dying (%d in a minute): stopping", len(self._deaths))
                    self._stop_frontends()
                    self._stop_core()
                    return 1
                self._start_frontend()
            if draining and not self.frontends:
                self._stop_core()
                log.info("drained; engine core stopped")
                return 0

    def _core_died(self) -> int:
        log.error("engine core (pid %d) died with exit code %s", self.core.pid, self.core.exitcode)
        self.shared.state[0] = FAILED  # front ends: streams get an error, /readyz and /healthz 503
        deadline = time.monotonic() + 3.0  # time for them to send the errors (watchdog period 0.5 s)
        while time.monotonic() < deadline and self._signals < 2:
            time.sleep(0.1)
        self._stop_frontends()
        return 1

    def _stop_frontends(self, timeout_s: float = 5.0) -> None:
        for p in self.frontends.values():
            _signal(p, signal.SIGTERM)  # they drain; with no engine that ends at once
        deadline = time.monotonic() + timeout_s
        for p in self.frontends.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
        self.frontends.clear()

    def _stop_core(self) -> None:
        if self.core is None or not self.core.is_alive():
            return
        self._tell_core(m.Stop())
        self.core.join(CORE_STOP_TIMEOUT_S)
        if self.core.is_alive():
            self.core.kill()

    def _tell_core(self, msg) -> None:
        if self._control is not None:
            self._control.send(m.control_encoder.encode(msg))

    def _kill_all(self) -> None:
        for p in list(self.frontends.values()) + ([self.core] if self.core else []):
            if p.is_alive():
                p.kill()

    def _on_signal(self, sig, frame) -> None:
        self._signals += 1

    def _mark_dead(self, pid: int) -> None:
        try:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid, self.metrics_dir)
        except Exception:  # noqa: BLE001 - metrics cleanup must never stop the supervisor
            pass

    def _cleanup(self) -> None:
        self._kill_all()
        for p in list(self.frontends.values()) + ([self.core] if self.core else []):
            p.join(1.0)
        if self._control is not None:
            self._control.close(0)
        self._zmq.term()
        if self.shared is not None:
            self.shared.close()
        if self._port_socket is not None:
            self._port_socket.close()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _signal(p: mp.Process, sig: int) -> None:
    try:
        os.kill(p.pid, sig)
    except (ProcessLookupError, TypeError):
        pass


def run_server(settings, frontends: int) -> int:
    return Supervisor(settings, frontends).run()

"""The supervisor: the `nemo-serve` process itself, which starts and watches every other one.

  0 reserve the ports (step 3): a port another program holds fails start-up at once, before any
    model is built
  1 spawn one engine core per device (--devices; one on --device by default); each loads the
    model and reports its ModelInfo (or a load error: exit 2)  (core_set.py, as a Ray replica)
  2 create each core's shared memory (slot table, audio rings) now that the sample rate is known
  3 spawn K front ends on one port (SO_REUSEPORT); the port is reserved here first, so
    --port 0 gives every front end the same free port. With --grpc-port each front end also
    serves Riva gRPC on that port, reserved the same way. Every front end talks to every core and
    sends each new stream to the core with the most free slots (core/group.py)
  4 watch: a front end that dies has its streams aborted and its slots freed in the cores, and
    is replaced; a core that dies is marked FAILED in its shared memory (the front ends fail its
    streams with an error; new streams go to the other cores). When no core is left, everything
    stops and the exit status is 1 (with one core: its death), for the process supervisor
    (systemd, Kubernetes) to restart the server; /readyz answers 503 meanwhile
  5 SIGTERM or Ctrl-C: each front end drains (every open stream gets its final), then the cores
    stop; exit 0. A second signal stops everything at once.
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

from ..console import print_urls
from . import messages as m
from .core_set import Core, CoreSet, CoreStartError
from .frontend_process import bind_reuseport, run_frontend_process
from .shared import FAILED

log = logging.getLogger("nemo_serve.supervisor")

MAX_RESTARTS_PER_MINUTE = 10


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
        self.core_set = CoreSet(settings, self.ipc_dir, interrupted=lambda: self._signals > 0)
        self.cores: list[Core] = self.core_set.cores
        self.frontends: dict[int, mp.Process] = {}  # front-end id -> process
        self._next_id = 0
        self._deaths: list[float] = []
        self._signals = 0
        # A signal writes a byte here (signal.set_wakeup_fd), so the watch loop wakes at once and
        # the front ends start their drain when the supervisor got SIGTERM, not up to a poll later.
        self._wakeup_r, self._wakeup_w = os.pipe()
        for fd in (self._wakeup_r, self._wakeup_w):
            os.set_blocking(fd, False)
        self._port_socket = None
        self._grpc_socket = None
        self._fast_ws_socket = None
        self._fast_grpc_socket = None

    # ------------------------------------------------------------------ main
    def run(self) -> int:
        previous = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir  # inherited by every child
        handlers = signal.signal(signal.SIGTERM, self._on_signal), signal.signal(signal.SIGINT, self._on_signal)
        wakeup_fd = signal.set_wakeup_fd(self._wakeup_w)
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
            signal.set_wakeup_fd(wakeup_fd)
            signal.signal(signal.SIGTERM, handlers[0])
            signal.signal(signal.SIGINT, handlers[1])
            os.close(self._wakeup_r)
            os.close(self._wakeup_w)

    def _run(self) -> int:
        # The ports first: a taken port fails in a second, not after the model is built. Bound, not
        # listening, so no connection is accepted before the front ends start (after the cores are up).
        try:
            self._reserve_ports()
        except PortTaken as e:  # one line, as a front end whose gRPC server cannot start (runner.py)
            print(f"nemo-serve: error: {e}", file=sys.stderr, flush=True)
            return PORT_TAKEN_STATUS
        try:
            self.core_set.start()
        except CoreStartError as e:
            if e.status == 2:  # as a bad flag: one line, status 2
                print(f"nemo-serve: error: {e}", file=sys.stderr, flush=True)
            else:
                log.error("%s", e)
            return e.status
        info = self.info = self.core_set.info
        print(info.summary, flush=True)
        ring_mib = sum(c.shared.layout.nbytes for c in self.cores) / 2**20
        where = ", ".join(f"pid {c.process.pid} on {c.device}" for c in self.cores)
        print(f"engine core{'s' if len(self.cores) > 1 else ''} {where}; {self.num_frontends} front-end processes on port "
              f"{self.port}; shared memory {ring_mib:.1f} MiB ({self.settings.audio_ring_s:g} s audio ring per slot)",
              flush=True)  # fmt: skip
        for _ in range(self.num_frontends):
            self._start_frontend()
        print_urls(self.settings, self.port)
        return self._watch()

    def _reserve_ports(self) -> None:
        """Bind (not listen) a SO_REUSEPORT socket per port: it fixes the port (for --port 0 too)
        and keeps it ours between front-end restarts; only listening sockets get connections."""
        self._port_socket = _bind("--port", self.settings.host, self.settings.port)
        self.port = self._port_socket.getsockname()[1]
        if self.settings.grpc_port is not None:  # reserved the same way: --grpc-port 0 too
            self._grpc_socket = _bind("--grpc-port", self.settings.host, self.settings.grpc_port)
            self.settings = self.settings.model_copy(update={"grpc_port": self._grpc_socket.getsockname()[1]})
        if self.settings.fast_ws_port is not None:  # likewise
            self._fast_ws_socket = _bind("--fast-ws-port", self.settings.host, self.settings.fast_ws_port)
            self.settings = self.settings.model_copy(update={"fast_ws_port": self._fast_ws_socket.getsockname()[1]})
        if self.settings.fast_grpc_port is not None:  # likewise
            self._fast_grpc_socket = _bind("--fast-grpc-port", self.settings.host, self.settings.fast_grpc_port)
            self.settings = self.settings.model_copy(update={"fast_grpc_port": self._fast_grpc_socket.getsockname()[1]})

    def _start_frontend(self) -> None:
        fid, self._next_id = self._next_id, self._next_id + 1
        p = self.mp.Process(
            target=run_frontend_process,
            args=(self.settings, self.info, self.core_set.endpoints(), fid, self.port, self.num_frontends),
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
            alive = [c for c in self.cores if not c.dead]
            sentinels = [c.process.sentinel for c in alive] + [p.sentinel for p in self.frontends.values()]
            if self._wakeup_r in multiprocessing.connection.wait(sentinels + [self._wakeup_r], timeout=0.5):
                _read_all(self._wakeup_r)
            for core in alive:
                if not core.process.is_alive():
                    self._core_died(core)
            if all(c.dead for c in self.cores):
                return self._no_core_left()
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

    def _core_died(self, core: Core) -> None:
        core.dead = True
        left = sum(not c.dead for c in self.cores)
        log.error("engine core %d on %s (pid %d) died with exit code %s; %d core(s) left", core.index, core.device,
                  core.process.pid, core.process.exitcode, left)  # fmt: skip
        # Front ends: its streams get an error; new streams go to the other cores (if any).
        core.shared.state[0] = FAILED
        self._mark_dead(core.process.pid)

    def _no_core_left(self) -> int:
        # Every stream has had its error (or gets it now), /readyz and /healthz answer 503.
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
        self.core_set.stop()

    def _tell_core(self, msg) -> None:
        self.core_set.tell(msg)

    def _processes(self) -> list:
        return list(self.frontends.values()) + [c.process for c in self.cores if c.process is not None]

    def _kill_all(self) -> None:
        for p in self._processes():
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
        for p in self._processes():
            p.join(1.0)
        self.core_set.close()
        for sock in (self._port_socket, self._grpc_socket, self._fast_ws_socket, self._fast_grpc_socket):
            if sock is not None:
                sock.close()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _read_all(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _signal(p: mp.Process, sig: int) -> None:
    try:
        os.kill(p.pid, sig)
    except (ProcessLookupError, TypeError):
        pass


PORT_TAKEN_STATUS = 3  # uvicorn's STARTUP_FAILURE, which a front end whose port fails exits with


class PortTaken(Exception):
    pass


def _bind(flag: str, host: str, port: int):
    """bind_reuseport, its OSError (a port another program listens on) as one line naming the flag."""
    try:
        return bind_reuseport(host, port)
    except OSError as e:
        raise PortTaken(f"{flag} {port} on {host}: {e.strerror or e}") from None


def run_server(settings, frontends: int) -> int:
    return Supervisor(settings, frontends).run()

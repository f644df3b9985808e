"""nemo-serve on Ray Serve: one replica per GPU, many hosts, one HTTP/WebSocket entry point.

    pip install -e '.[ray]'
    ray start --head                              # on each host: ray start --address=HEAD:6379
    serve run deploy/ray_serve.yaml               # or: python -m nemo_serve.ray_serve --replicas 2

Each replica is a whole nemo-serve: the same engine-core process(es) as `nemo-serve` runs (one per
device of the replica), with the replica itself as their one front end (build_frontend, as a
front-end process: the same app, protocol, auth, caps, metrics and log redaction), built on the
replica from NEMO_SERVE_* environment variables (the same settings as the flags, through
compose.py). Ray's proxy carries each WebSocket to one replica for its life; a socket is one
ongoing request there, so Ray's own counters follow the open streams. Around what Ray does by
itself (measured in issue 17: sockets beyond `max_ongoing_requests` wait in the proxy, and
`max_queued_requests` answers 500 and refuses sockets that fit):

- routing: `MostFreeSlotsRouter` offers every replica as one rank, so Ray picks the one with the
  fewest ongoing requests among those that accept: with the same slots everywhere, the one with
  the most free slots (Ray's default samples two replicas and can miss the free one), probing
  them all whenever its queue-length cache lacks one (else it passes over that one);
- refusal at once: `max_ongoing_requests` is the slots plus headroom, so when every replica is full
  the socket still reaches one, and nemo-serve's own admission answers 503 at the handshake (or
  1013) at once instead of the proxy queueing it; no `max_queued_requests`;
- autoscaling on open streams versus slots: `target_ongoing_requests` is a fraction of the slots;
- health: `check_health` raises once the replica's engine cores are all dead, so Ray stops routing
  to it and replaces it (a dead replica refuses at once, so would otherwise draw every new stream);
- drain: a replica being scaled down gets no new sockets; its open streams get application()'s
  `graceful_shutdown_timeout_s` to end on their own, then the replica drains the rest as
  `nemo-serve` does on SIGTERM (each ends `draining` with the final of the audio it took in,
  within --drain-timeout-s). Ray runs an app's
  shutdown only after every ongoing request ended, which an open stream never does, and offers no
  hook at the start of its graceful shutdown: so the replica watches its own state on Ray's
  controller (`_stop_timeout_s`), and Ray's `graceful_shutdown_timeout_s` is set to the wait plus
  the drain, so that Ray's kill comes after both.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

from ray import serve
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from .server.connections import PROBE_PATHS
from .server.protocol import CLOSE_TRY_AGAIN_LATER

_REPLICA_CONTEXT: list = []  # this replica's ServerContext, for check_health (one replica per Ray actor process)
SLOT_HEADROOM = 16  # sockets past the slots a replica takes, to refuse them itself at once
STOP_POLL_S = 0.25  # how often a replica asks Ray's controller whether it is being stopped
SHUTDOWN_MARGIN_S = 5.0  # Ray's kill deadline past the wait and the drain: the poll, the close frames, the exit


class MostFreeSlotsRouter(FIFOMixin, RequestRouter):
    """Every replica in one rank: Ray then takes the replica with the fewest ongoing requests (open
    sockets) among those that accept. Replicas have the same slots, so that is the most free slots.

    Ray compares only the replicas its queue-length cache holds, and probes the others in the
    background: a replica that is new, or whose probe missed its deadline, was passed over while a
    cached one took stream after stream until its slots ran out and it refused them (CI saw a
    stream refused while the other replica had a free slot). So when any candidate is
    missing from the cache, every candidate's entry is dropped and Ray probes them all together, and
    a probe may take half a second (Ray's default 0.1 s: a busy replica answers late on CI)."""

    queue_len_response_deadline_s = 0.5
    max_queue_len_response_deadline_s = 2.0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        cache = self.replica_queue_len_cache
        if any(cache.get(r.replica_id) is None for r in candidate_replicas):
            for r in candidate_replicas:
                cache.invalidate_key(r.replica_id)
        return [list(candidate_replicas)] if candidate_replicas else []


def build_app():
    """Runs on each replica: the replica starts its engine core(s) as `nemo-serve` does (the same
    CoreSet and processes, from NEMO_SERVE_*: the deployment's env_vars), and is itself their one
    front end: Ray's proxy hands it the sockets."""
    from .config import Settings
    from .core.core_set import CoreSet
    from .core.frontend_process import build_frontend

    settings = Settings.from_sources({}, os.environ)
    if settings.device == "cpu" and settings.devices is None and _ray_gpu_ids():
        settings = settings.model_copy(update={"device": "cuda"})  # Ray sets CUDA_VISIBLE_DEVICES to this replica's GPU
    ipc_dir = tempfile.mkdtemp(prefix="nemo-serve-replica-")
    cores = CoreSet(settings, ipc_dir)
    watching = threading.Event()

    def stop_cores() -> None:
        watching.set()
        cores.stop()
        cores.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)

    try:
        cores.start()
    except BaseException:
        cores.kill()
        cores.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)
        raise
    print(cores.info.summary, flush=True)  # a replica has no logging set up for nemo_serve's loggers
    threading.Thread(target=cores.watch, args=(watching,), name="engine-cores-watch", daemon=True).start()
    # The same front end as a front-end process (caps, redaction, metrics, drain); Ray's proxy owns
    # the sockets, so the caps apply to the requests it hands over (ConnectionCaps) and the header
    # deadline is the proxy's (it has read the headers before the replica sees the request).
    built = build_frontend(settings, cores.info, cores.endpoints(), 0, drain_on_shutdown=True, on_shutdown=stop_cores)
    built.app.add_middleware(ConnectionCaps, limiter=built.limiter)
    _drain_when_stopped(built.app, built.ctx)
    _REPLICA_CONTEXT.append(built.ctx)
    return built.app


class ConnectionCaps:
    """--max-connections and --max-connections-per-ip on a replica: each request or WebSocket that
    Ray's proxy hands over counts, while it runs, as a connection from its client's address (probes
    do not count, as in connections.py); one over a cap is refused before the app sees it: 503, or
    close 1013 before a WebSocket is accepted."""

    def __init__(self, app, limiter) -> None:
        self.app, self.limiter = app, limiter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path", "").encode() in PROBE_PATHS:
            return await self.app(scope, receive, send)
        connection = object()  # the limiter's key for this request
        reason = self.limiter.acquire(connection, (scope.get("client") or ("unknown",))[0])
        if reason is not None:
            return await _refuse(scope, send, reason)
        try:
            await self.app(scope, receive, send)
        finally:
            self.limiter.release(connection)


async def _refuse(scope, send, reason: str) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": CLOSE_TRY_AGAIN_LATER, "reason": reason[:120]})
        return
    body = reason.encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


def _drain_when_stopped(app, ctx) -> None:
    """Runs beside the app's lifespan: once Ray stops this replica, the open streams get the wait
    application() was given to end on their own, then the replica drains (ctx.drain: each open
    stream ends `draining` with its final). The app's own shutdown drain is too late on Ray: Ray
    calls it only after the last ongoing request (an open socket) ended."""
    inner = app.router.lifespan_context

    async def drain_once_stopped() -> None:
        while (ray_timeout_s := await asyncio.to_thread(_stop_timeout_s)) is None:
            await asyncio.sleep(STOP_POLL_S)
        stream_wait_s = max(0.0, ray_timeout_s - ctx.settings.drain_timeout_s - SHUTDOWN_MARGIN_S)
        print(f"replica stopping: {len(ctx.sessions)} open streams get {stream_wait_s:g} s, then drain", flush=True)
        deadline = time.monotonic() + stream_wait_s
        while ctx.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await ctx.drain()

    @contextlib.asynccontextmanager
    async def lifespan(a):
        async with inner(a) as state:
            watcher = asyncio.create_task(drain_once_stopped(), name="ray-stop-watch")
            try:
                yield state
            finally:
                watcher.cancel()

    app.router.lifespan_context = lifespan


def _stop_timeout_s() -> float | None:
    """None while this replica runs; once Ray's controller marks it STOPPING (scaled down, replaced,
    deleted), the deployment's graceful_shutdown_timeout_s, the time Ray gives it before the kill.
    One of the module's two private Ray APIs (`_get_global_client`; application()'s `_internal`
    version the other): serve.status() reads the same
    details but counts replicas per state without saying which. A replica the controller no longer
    lists is stopping too."""
    from ray.serve.context import _get_global_client

    replica = serve.get_replica_context()
    apps = _get_global_client().get_serve_details().get("applications", {})
    deployment = apps.get(replica.app_name, {}).get("deployments", {}).get(replica.deployment, {})
    timeout_s = float(deployment.get("deployment_config", {}).get("graceful_shutdown_timeout_s", 0.0))
    for r in deployment.get("replicas", []):
        if r.get("replica_id") == replica.replica_tag:
            return timeout_s if r.get("state") == "STOPPING" else None
    return timeout_s


def _ray_gpu_ids() -> list:
    try:
        import ray

        return ray.get_gpu_ids()
    except Exception:  # noqa: BLE001 - outside a Ray worker
        return []


@serve.deployment(name="nemo-serve")
@serve.ingress(build_app)
class NemoServe:
    def check_health(self) -> None:
        """Ray calls it every health_check_period_s; raising marks the replica unhealthy, so Ray
        stops routing to it and replaces it. Without it a replica whose engine cores died stayed
        routable, refused every stream at once, so had the fewest ongoing requests, which
        MostFreeSlotsRouter prefers: every new stream went there."""
        _check_engine_cores()


def _check_engine_cores() -> None:
    """Module-level on purpose: Ray pickles the deployment class by value, with a copy of the
    globals its methods name (an empty _REPLICA_CONTEXT: the first version never raised); a module
    function is pickled by reference and reads the replica's own list."""
    for ctx in _REPLICA_CONTEXT:
        if not ctx.engine_alive:
            raise RuntimeError(f"engine core failed: {ctx.engine.error}")


def application(
    num_slots: int = 16,
    replicas: int | None = 2,
    env: dict[str, str] | None = None,
    gpus: float = 0.0,
    cpus: float = 1.0,
    autoscale: tuple[int, int] | None = None,
    target_fill: float = 0.75,
    graceful_shutdown_timeout_s: float = 60.0,
    health_check_period_s: float = 2.0,
    code_version: str | None = None,
):
    """The bound Serve application. `env`: NEMO_SERVE_* settings of every replica (model, context
    right, dtype, ...); `autoscale`: (min, max) replicas, scaling at `target_fill` x slots open per
    replica, instead of a fixed `replicas`. `graceful_shutdown_timeout_s`: how long a replica being
    stopped lets its open streams end on their own before it drains them; Ray's own timeout is that
    plus --drain-timeout-s (so the drain finishes before Ray kills the replica).
    `health_check_period_s`: between Ray's calls of check_health (three failures in a row take a
    replica out of routing). `code_version`: Ray's version of the replicas' code. Without one
    (Ray's default for serve.run) each serve.run draws a new version and replaces every replica,
    one at a time, each building its model again; with the same one given again, a serve.run that
    changes only the replica count or graceful_shutdown_timeout_s scales and reconfigures the
    running replicas in place."""
    from .config import Settings

    env_vars = {"NEMO_SERVE_NUM_SLOTS": str(num_slots), **(env or {})}
    drain_timeout_s = Settings.from_sources({}, env_vars).drain_timeout_s
    options = dict(
        max_ongoing_requests=num_slots + SLOT_HEADROOM,
        ray_actor_options={"num_cpus": cpus, "num_gpus": gpus, "runtime_env": {"env_vars": env_vars}},
        request_router_config={"request_router_class": MostFreeSlotsRouter},
        graceful_shutdown_timeout_s=graceful_shutdown_timeout_s + drain_timeout_s + SHUTDOWN_MARGIN_S,
        graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=health_check_period_s,
    )
    if code_version is not None:  # Ray 2.60 took `version` out of its public options; _internal still takes it
        options.update(version=code_version, _internal=True)
    if autoscale is not None:
        options["autoscaling_config"] = {
            "min_replicas": autoscale[0], "max_replicas": autoscale[1],
            "target_ongoing_requests": max(1.0, target_fill * num_slots),
            "upscale_delay_s": 5.0, "downscale_delay_s": 60.0,
        }  # fmt: skip
    else:
        options["num_replicas"] = replicas
    return NemoServe.options(**options).bind()


def app_builder(args: dict):
    """`serve run nemo_serve.ray_serve:app_builder num_slots=16 replicas=2` and Serve config files."""
    env = {k: str(v) for k, v in args.items() if k.startswith("NEMO_SERVE_")}
    auto = args.get("autoscale")
    return application(
        num_slots=int(args.get("num_slots", 16)),
        replicas=int(args.get("replicas", 2)),
        env=env,
        gpus=float(args.get("gpus", 0.0)),
        cpus=float(args.get("cpus", 1.0)),
        autoscale=tuple(int(x) for x in str(auto).split(",")) if auto else None,
        graceful_shutdown_timeout_s=float(args.get("graceful_shutdown_timeout_s", 60.0)),
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="nemo-serve on a Ray Serve cluster (one replica per device)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--autoscale", default=None, metavar="MIN,MAX")
    p.add_argument("--num-slots", type=int, default=16)
    p.add_argument("--gpus", type=float, default=0.0, help="GPUs per replica (1 on a GPU cluster)")
    p.add_argument("--cpus", type=float, default=1.0)
    args = p.parse_args(argv)
    import ray

    ray.init(address=args.address, include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    env = {k: v for k, v in os.environ.items() if k.startswith("NEMO_SERVE_")}
    auto = tuple(int(x) for x in args.autoscale.split(",")) if args.autoscale else None
    serve.run(application(args.num_slots, args.replicas, env, args.gpus, args.cpus, auto), name="nemo-serve", route_prefix="/")
    print(f"nemo-serve on Ray Serve: ws://{args.host}:{args.port}/ws", flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM as Ctrl-C: replicas drain, cores stop
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

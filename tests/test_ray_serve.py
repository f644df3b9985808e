"""nemo-serve on Ray Serve: a local Ray cluster with two CPU replicas of the demo model.

Needs `pip install -e '.[ray]'` (ray[serve]), which `.ci/run` installs; skipped without it.
Checks: streams spread over both replicas, every stream token-identical to NeMo's loop, a full
cluster refuses a new stream at once (503 at the handshake) while a stream that fits is never
refused, a replica scaled down loses no final (and drains streams that outlast Ray's wait), a
replica runs the engine-core process (the same as `nemo-serve`), the replicas honour every setting
(--word-confidence: once dropped there), a replica's connection caps refuse past the cap, a
replica whose engine core died leaves routing (check_health) while new streams are served, and a
redeploy of the same code version scales the running replicas instead of replacing them (so that
this file's scale-downs take about a second and a scale-up builds one replica, not all of them).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from nemo_serve.client import ServerRefused  # noqa: E402

from . import helpers  # noqa: E402
from .helpers_server import TOKEN, encode, free_port  # noqa: E402
from .helpers_e2e import check_well_formed, oracle_tokens, stream  # noqa: E402

SLOTS = 2
HOP = 160  # samples per feature frame (10 ms at 16 kHz)


def deploy(env: dict, replicas: int, **options) -> None:
    """serve.run of the app at `replicas`, with one code version throughout: a redeploy then scales
    and reconfigures the running replicas (about 1 s) instead of replacing every one of them, one
    after the other, each building its model again (about 13 s each on CI). Health checked every
    0.5 s (production: 2 s), so a dead engine core leaves routing in about 1.5 s."""
    from nemo_serve.ray_serve import application

    app = application(num_slots=SLOTS, replicas=replicas, env=env, cpus=0.5, health_check_period_s=0.5,
                      code_version="test", **options)  # fmt: skip
    serve.run(app, name="nemo-serve", route_prefix="/")


def replica_pid(url: str) -> int:
    import httpx

    return httpx.get(url.replace("ws://", "http://").replace("/ws", "/readyz"), timeout=10, trust_env=False).json()["pid"]


@pytest.fixture(scope="module")
def cluster():
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    env = {"NEMO_SERVE_AUTH_TOKEN": TOKEN, "NEMO_SERVE_IDLE_TIMEOUT_S": "20", "NEMO_SERVE_LOG_LEVEL": "warning",
           "NEMO_SERVE_WORD_CONFIDENCE": "true"}  # fmt: skip
    deploy(env, replicas=2)
    yield f"ws://127.0.0.1:{port}/ws", env
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def oracle_model():
    return helpers.model(None, None)


def test_streams_spread_tokens_identical_full_cluster_refuses_at_once(cluster, oracle_model):
    url, _ = cluster
    utts = helpers.utterances(5, seed=17)
    wires = [encode(u, "pcm_f32le") for u in utts]

    async def scenario():
        tasks = []
        for w in wires[:4]:  # four streams fit: 2 replicas x 2 slots; none may be refused
            tasks.append(asyncio.create_task(stream(url, w, 16000, "pcm_f32le", speed=1.0, packet=1600)))
            await asyncio.sleep(0.3)
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        refused = None
        try:
            await stream(url, wires[4], 16000, "pcm_f32le", speed=0.0)
        except ServerRefused as e:
            refused = e
        refusal_s = time.monotonic() - t0
        return await asyncio.gather(*tasks), refused, refusal_s

    transcripts, refused, refusal_s = asyncio.run(scenario())
    for t, w in zip(transcripts, wires):
        check_well_formed(t)  # every stream that fit was served
        assert t.token_ids == oracle_tokens(oracle_model, w, 16000)
        words = [word for f in t.finals for word in f["words"]]
        assert words and all(0.0 <= word["confidence"] <= 1.0 for word in words)  # --word-confidence honoured
    assert refused is not None and "no free slot" in refused.reason, refused
    assert refusal_s < 3.0, refusal_s  # at once, not queued in Ray's proxy
    # Spread: four streams at once with two slots per replica were all served, so each replica
    # held two; a router that sent three to one replica would have had one refused above.


def test_a_replica_runs_the_engine_core_process(cluster):
    """The replica's /readyz names the process that steps the model: a child of the replica (the
    engine core), not the replica itself, which is only its front end."""
    import httpx

    url, _ = cluster
    body = httpx.get(url.replace("ws://", "http://").replace("/ws", "/readyz"), timeout=10, trust_env=False).json()
    assert len(body["cores"]) == 1 and body["cores"][0]["serving"]
    assert body["cores"][0]["pid"] != body["pid"]  # the core's process is not the replica's


def test_replica_whose_engine_core_died_leaves_routing_new_streams_go_to_a_healthy_one(cluster, oracle_model):
    """Issue 47: a long stream holds one replica; /readyz then answers from the other (fewest ongoing
    requests), whose engine core is killed. That replica refuses at once, so it keeps the fewest
    ongoing requests, which MostFreeSlotsRouter prefers: without check_health every new request
    went to it. Its check_health raises, so Ray stops routing to it (and replaces it): within 60 s,
    ten /readyz in a row answer from replicas whose core serves, and new streams are served
    token-identical to NeMo's loop; the long stream is unharmed (it ends its input once they are
    served: it holds its replica as long as the check needs, no longer)."""
    import os
    import signal

    import httpx

    url, env = cluster
    deploy(env, replicas=2)
    readyz = url.replace("ws://", "http://").replace("/ws", "/readyz")
    long_wire = encode(np.concatenate(helpers.utterances(8, seed=41)), "pcm_f32le")  # ~25 s at most
    wires = [encode(u, "pcm_f32le") for u in helpers.utterances(2, seed=37)]

    def get():
        return httpx.get(readyz, timeout=10, trust_env=False)

    async def scenario():
        released = asyncio.Event()
        holder = asyncio.create_task(stream(url, long_wire, 16000, "pcm_f32le", speed=1.0, until=released))
        await asyncio.sleep(1.5)
        other = (await asyncio.to_thread(get)).json()
        assert other["open_streams"] == 0, other  # the replica without the long stream answered
        os.kill(other["cores"][0]["pid"], signal.SIGKILL)
        deadline, in_a_row, answers = time.monotonic() + 60, 0, []
        while in_a_row < 10:
            assert time.monotonic() < deadline, answers[-12:]
            r = await asyncio.to_thread(get)
            serving = r.status_code == 200 and all(c["serving"] for c in r.json()["cores"])
            answers.append((r.status_code, r.json().get("pid")))
            in_a_row = in_a_row + 1 if serving else 0
            await asyncio.sleep(0.2)
        served = [await stream(url, w, 16000, "pcm_f32le", speed=0.0) for w in wires]
        assert not holder.done()  # the long stream held its replica throughout
        released.set()
        return served, await holder

    served, held = asyncio.run(scenario())
    check_well_formed(held)
    for t, w in zip(served, wires):
        check_well_formed(t)
        assert t.token_ids == oracle_tokens(oracle_model, w, 16000)


def replica_states() -> dict[int, str]:
    """pid -> Ray's state of each of the app's replicas (RUNNING, STOPPING, ...), from Ray's
    controller: the details serve.status() counts without naming replicas (the private API that
    nemo_serve/ray_serve.py's _stop_timeout_s reads too)."""
    from ray.serve.context import _get_global_client

    app = _get_global_client().get_serve_details()["applications"]["nemo-serve"]
    return {r["pid"]: r["state"] for r in app["deployments"]["nemo-serve"]["replicas"]}


def test_a_replica_scaled_down_lets_short_streams_end_and_drains_long_ones(cluster, oracle_model):
    """A replica scaled down mid-stream: Ray's wait for its open streams (graceful_shutdown_timeout_s,
    here 5 s) lets the short ones end on their own, so a scale-down loses no final (`end`, all their
    audio, NeMo's tokens); the ones that outlast it the replica drains as `nemo-serve` does on
    SIGTERM: `draining`, with NeMo's loop on the prefix it took in. (Before the fix, Ray ran the
    app's drain only after every open stream had ended, and killed the replica first: streams ended
    1006 with no `done`.) Four streams fill both replicas' two slots; where Ray routed each is read
    from the replica that answers /readyz as it opens (its pid and open streams), and each
    replica's first is made the short one (its client ends its input once Ray marks the leaving
    replica STOPPING), its second the long one. So whichever replica leaves holds one of each,
    however Ray routed (with the roles fixed in advance, short, short, long, long, a run whose two
    short streams both went to the leaving replica would have had nothing there to drain; runs
    here saw Ray put the first two streams on one replica). One scale-down for both checks: each
    takes a replica that the next test must start again, ~13 s on CI."""
    import httpx

    url, env = cluster
    deploy(env, replicas=2)  # (the replica replaced in the test above: this waits for it)
    parts = helpers.utterances(24, seed=29)
    # six utterances each (~20 s): longer than the opening and Ray's wait together
    wires = [encode(np.concatenate(parts[i : i + 6]), "pcm_f32le") for i in range(0, 24, 6)]
    pids = {pid for pid, state in replica_states().items() if state == "RUNNING"}
    assert len(pids) == 2, pids
    readyz = url.replace("ws://", "http://").replace("/ws", "/readyz")
    ends = [asyncio.Event() for _ in wires]  # set: that stream's client ends its input
    sent: list[list] = [[] for _ in wires]

    async def placed(task: asyncio.Task, k: int, where: dict[int, int]) -> int:
        """The pid of the replica stream `k` holds a slot on (it has had `ready`: it sent audio)."""
        async with asyncio.timeout(30):
            while not sent[k]:
                if task.done():
                    task.result()  # refused: raises
                await asyncio.sleep(0.05)
        body = (await asyncio.to_thread(httpx.get, readyz, timeout=10, trust_env=False)).json()
        mine = sum(1 for pid in where.values() if pid == body["pid"])  # our open streams there
        assert body["open_streams"] in (mine, mine + 1), (body["open_streams"], where)
        return body["pid"] if body["open_streams"] == mine + 1 else (pids - {body["pid"]}).pop()

    async def scenario():
        tasks, where = [], {}
        for k, w in enumerate(wires):
            # A stream refused while the other replica has a free slot is opened again: Ray's proxy
            # routes on what it last heard from the replicas, and beside heavy load (the CI run at
            # e533e37; runs here after the router fix) it sent one to the full one. Routing is the first test's
            # check; this one needs the four streams placed. Bounded: a router that kept choosing
            # the full replica fails here.
            for attempt in range(20):
                task = asyncio.create_task(stream(url, w, 16000, "pcm_f32le", speed=1.0, packet=1600, until=ends[k],
                                                  sent=sent[k]))  # fmt: skip
                try:
                    where[k] = await placed(task, k, where)
                    break
                except ServerRefused:
                    if attempt == 19:
                        raise
                    await asyncio.sleep(0.5)
            tasks.append(task)
        on = {pid: [k for k in where if where[k] == pid] for pid in pids}
        assert sorted(map(len, on.values())) == [2, 2], where  # two slots each: all four served
        scale_down = asyncio.create_task(asyncio.to_thread(deploy, env, replicas=1, graceful_shutdown_timeout_s=5.0))
        async with asyncio.timeout(30):
            while not (leaving := [pid for pid, state in replica_states().items() if state == "STOPPING"]):
                await asyncio.sleep(0.1)
        (leaving,) = leaving
        shorts = {pid: ks[0] for pid, ks in on.items()}
        for k in shorts.values():
            ends[k].set()  # ends within Ray's wait, on either replica
        long_leaving = on[leaving][1]
        await asyncio.wait([tasks[long_leaving]], timeout=60)  # drained once Ray's wait ran out
        for e in ends:
            e.set()  # the staying replica's long stream need not run on
        await scale_down
        return await asyncio.gather(*tasks), leaving, set(shorts.values()), long_leaving

    transcripts, leaving, shorts, long_leaving = asyncio.run(scenario())
    ends_seen = [(t.done, t.error, t.close_code) for t in transcripts]
    assert all(t.done is not None for t in transcripts), ends_seen  # each stream got its `done`
    reasons = [t.done["reason"] for t in transcripts]
    assert reasons == ["draining" if k == long_leaving else "end" for k in range(len(wires))], (leaving, ends_seen)
    for k, (t, w) in enumerate(zip(transcripts, wires)):
        check_well_formed(t)
        # audio_processed: the feature frames of the ended input, NeMo's floor(n / hop) + 1, in seconds
        frames = round(t.done["audio_processed"] * 16000) // HOP
        if k == long_leaving:  # cut short: the prefix the replica took in, to a hop
            taken = (frames - 1) * HOP  # (not whole packets: one run took in 21.6 of them through Ray's proxy)
            assert 0 < taken < len(w) - 1600, (taken, len(w))
        else:  # the client ended it: every sample it sent (the short ones: no final lost)
            taken = sent[k][-1][1]
            assert frames == taken // HOP + 1, (k, k in shorts, frames, taken)
        assert t.token_ids == oracle_tokens(oracle_model, w[:taken], 16000)


def test_a_redeploy_of_the_same_code_version_keeps_the_running_replica(cluster):
    """application(code_version=...): a serve.run that changes only Ray's wait for open streams
    reconfigures the one running replica in place (the same process answers /readyz after it);
    Ray's default, a new version per serve.run, replaced it (seen to fail with code_version=None:
    another pid, after a new replica had built its model)."""
    url, env = cluster
    deploy(env, replicas=1)
    before = replica_pid(url)
    deploy(env, replicas=1, graceful_shutdown_timeout_s=30.0)
    assert replica_pid(url) == before


def test_replica_connection_caps_refuse_past_the_per_address_cap():
    """A replica's ConnectionCaps (Ray's proxy owns the sockets): with --max-connections-per-ip 1, a
    second WebSocket from the same address while the first runs is closed 1013 before the app sees
    it, another address is let in, a probe passes beyond the caps, and once the first ends the
    address may connect again."""
    from nemo_serve.ray_serve import ConnectionCaps
    from nemo_serve.server.connections import ConnectionLimiter

    async def scenario():
        release, seen = asyncio.Event(), []

        async def app(scope, receive, send):
            seen.append((scope["client"][0], scope["path"]))
            if scope["client"][0] == "10.0.0.1" and len(seen) == 1:
                await release.wait()

        caps = ConnectionCaps(app, ConnectionLimiter(max_total=8, max_per_ip=1))
        sent = []

        async def send(message):
            sent.append(message)

        def ws(ip, path="/ws"):
            return {"type": "websocket", "path": path, "client": (ip, 5000)}

        first = asyncio.create_task(caps(ws("10.0.0.1"), None, send))
        await asyncio.sleep(0.01)
        await caps(ws("10.0.0.1"), None, send)  # over the cap
        await caps(ws("10.0.0.2"), None, send)
        await caps({"type": "http", "path": "/readyz", "client": ("10.0.0.1", 5001)}, None, send)
        release.set()
        await first
        await caps(ws("10.0.0.1"), None, send)
        return seen, sent

    seen, sent = asyncio.run(scenario())
    assert seen == [("10.0.0.1", "/ws"), ("10.0.0.2", "/ws"), ("10.0.0.1", "/readyz"), ("10.0.0.1", "/ws")], seen
    assert [m["type"] for m in sent] == ["websocket.close"] and sent[0]["code"] == 1013, sent
    assert "too many connections from your address" in sent[0]["reason"]

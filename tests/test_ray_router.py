"""MostFreeSlotsRouter inside Ray's own routing loop (Ray's request router with in-memory replicas,
`ray.serve._private.test_utils.FakeRunningReplica`): a stream goes to the replica with the fewest
open streams, including one that Ray's queue-length cache does not hold yet (new, or its probe
missed the deadline). Before the fix Ray chose the cached replica whatever it held, so it took
streams until its slots ran out and refused them while another replica had free slots (a CI run of
test_ray_serve.py: 'no free slot (all 2 in use)' with two of four slots free). Needs ray[serve]."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve")
from ray.serve._private.common import DeploymentHandleSource, RequestMetadata  # noqa: E402
from ray.serve._private.request_router.common import PendingRequest  # noqa: E402
from ray.serve._private.test_utils import FAKE_REPLICA_DEPLOYMENT_ID, FakeRunningReplica  # noqa: E402

from nemo_serve.ray_serve import SLOT_HEADROOM, MostFreeSlotsRouter  # noqa: E402

SLOTS = 2


def route(open_streams: dict[str, int], cached: set[str], probe_s: float = 0.0) -> tuple[str, int]:
    """The replica Ray's router picks for one new stream, and how many probes it sent. Each replica
    holds `open_streams[name]`; those in `cached` are in the router's cache with that count, the
    others are not (new, or their probe missed its deadline); each probe takes `probe_s`."""

    async def scenario():
        router = MostFreeSlotsRouter(
            deployment_id=FAKE_REPLICA_DEPLOYMENT_ID,
            handle_source=DeploymentHandleSource.PROXY,
            self_actor_handle=object(),  # (a proxy's router pushes its handle to each replica)
            use_replica_queue_len_cache=True,  # as on Ray's proxy (strict max_ongoing_requests)
        )
        replicas = {
            name: FakeRunningReplica(name, max_ongoing_requests=SLOTS + SLOT_HEADROOM, sleep_time_s=probe_s)
            for name in open_streams
        }
        for name, r in replicas.items():
            r.set_queue_len_response(open_streams[name])
        router.update_replicas(list(replicas.values()))
        await asyncio.sleep(0.2 + probe_s)  # Ray probes new replicas once, in the background
        for name, r in replicas.items():  # then the cache holds exactly `cached`
            if name in cached:
                router.on_new_queue_len_info(r.replica_id, open_streams[name])
            else:
                router.replica_queue_len_cache.invalidate_key(r.replica_id)
        before = sum(r.num_get_queue_len_calls for r in replicas.values())
        pending = PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(request_id="r", internal_request_id="i"))
        chosen = await asyncio.wait_for(router._choose_replica_for_request(pending), 10)
        return chosen.replica_id.unique_id, sum(r.num_get_queue_len_calls for r in replicas.values()) - before

    return asyncio.run(scenario())


def test_a_replica_missing_from_the_cache_is_compared_not_passed_over():
    chosen, _ = route({"full": 2, "fresh": 0}, cached={"full"})
    assert chosen == "fresh"


def test_a_replica_whose_probe_takes_past_rays_default_deadline_is_still_compared():
    chosen, _ = route({"full": 2, "slow": 0}, cached={"full"}, probe_s=0.3)  # Ray's default: 0.1 s
    assert chosen == "slow"


def test_the_cache_decides_without_probes_when_it_holds_every_replica():
    assert route({"a": 2, "b": 1}, cached={"a", "b"}) == ("b", 0)
    assert route({"a": 1, "b": 2}, cached={"a", "b"}) == ("a", 0)

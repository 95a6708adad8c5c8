"""Shared state on Redis's own high-availability engines, with real processes on loopback: a
Sentinel set (master, replica, three sentinels; also over TLS with an ACL user) and a cluster
(three masters with a replica each, and an ACL user). Two proxy replicas share one route
limit, the cache and a
breaker trip; the master holding the route's keys is SIGKILLed while both serve steady load: no
request fails, and within 10 s of the promotion a trip in one replica holds the other again."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest

from policies.core.redislink import UNAVAILABLE, RedisLink
from proxy.app import STATE
from proxy.config import parse_config
from testkit.certs import tls_files
from testkit.fakevendor import FakeVendor, Fault
from testkit.redisha import Access, ClusterSet, SentinelSet
from testkit.waiting import eventually
from tests.conftest import Busy, route

FAIL_MAX = 3
BREAKER = {"fail_max": FAIL_MAX, "reset_timeout": "60s"}
CACHE = {"ttl": "10m", "lock_wait": "1s"}
# The breaker's record and the route's bucket share the {tavily} hash tag: one cluster slot.
ROUTE_TAG = "{tavily}"
WITHIN_AFTER_PROMOTION = 10.0
LOAD_EVERY = 0.02  # seconds between one replica's requests under steady load


class Topology:
    """A running topology, the proxy's `redis:` section for it, and how to kill the master
    that holds the route's keys."""

    def __init__(self, name: str, nodes: SentinelSet | ClusterSet) -> None:
        self.name = name
        self.nodes = nodes
        self._prefixes = itertools.count()

    def redis(self) -> dict[str, Any]:
        """A key prefix of its own per call: each test starts from empty shared state."""
        prefix = f"ha-{self.name}-{next(self._prefixes)}"
        return self.nodes.config(key_prefix=prefix, timeout="100ms")

    def kill_and_wait(self) -> tuple[str, str]:
        """SIGKILL the master holding the route's keys; (its address, its successor's) once the
        successor serves. Blocking: run it in a thread."""
        if isinstance(self.nodes, SentinelSet):
            old = self.nodes.kill_master()
            return f"127.0.0.1:{old}", self.nodes.wait_promoted(old).address
        master = self.nodes.master_of(ROUTE_TAG)
        self.nodes.kill(master)
        return master.address, self.nodes.wait_promoted(ROUTE_TAG, master).address


PASSWORD = "a-long-acl-password"


@pytest.fixture(scope="module", params=["sentinel", "sentinel-tls-acl", "cluster"])
def topology(request: pytest.FixtureRequest) -> Iterator[Topology]:
    """One topology for the module's tests; the kill test, last, ends it."""
    nodes: SentinelSet | ClusterSet
    if request.param == "sentinel":
        nodes = SentinelSet()
    elif request.param == "sentinel-tls-acl":
        nodes = SentinelSet(Access("proxy", PASSWORD, tls_files(), keys=f"ha-{request.param}-*"))
    else:  # an ACL user on the cluster, whose client asks for its layout and uses SSUBSCRIBE
        nodes = ClusterSet(masters=3, replicas=1, access=Access("proxy", PASSWORD, keys="ha-*"))
    with nodes:
        yield Topology(request.param, nodes)


async def two_replicas(
    topology: Topology, vendor: FakeVendor, start_proxy: Any, **policies: Any
) -> tuple[Any, Any]:
    """Two proxy replicas sharing the topology, each with its own link, once both links answer.

    A replica whose start-up could not reach Redis within its warm-up (a loaded machine, at the
    topology's 100 ms timeout: TLS, a sentinel's answer) starts on in-process state and tries
    Redis again a second later, as it should. These tests are about what replicas share, so
    they begin when both share: a link that never answers still fails them here."""
    config = {
        "redis": topology.redis(),
        "routes": {"tavily": route(vendor.url + "/tavily", "/tavily", **policies)},
    }
    a, b = await start_proxy(config), await start_proxy(config)
    for client in (a, b):
        await eventually(client.app[STATE].redis.ping, within=10.0, interval=0.1)
    return a, b


_queries = itertools.count()


async def search(client: Any, query: str | None = None) -> Any:
    body = {"query": query or f"query {next(_queries)}"}
    reply = await client.post("/tavily/search", json=body)
    await reply.read()
    return reply


async def trip(client: Any, vendor: FakeVendor) -> None:
    """Open `client`'s breaker: FAIL_MAX vendor failures through it alone."""
    vendor.set_default(Fault.status(503))
    try:
        for _ in range(FAIL_MAX):
            assert (await search(client)).status == 503
    finally:
        vendor.set_default(Fault.ok())


def metric_value(exposition: str, name: str) -> float:
    """The value of an unlabelled sample."""
    line = next(line for line in exposition.splitlines() if line.startswith(name + " "))
    return float(line.split()[-1])


async def refuses(client: Any) -> bool:
    """Whether `client`'s circuit is open (it answers without calling the vendor)."""
    return (await search(client)).headers.get("X-Circuit") == "open"


async def test_two_replicas_draw_from_one_route_limit(
    topology: Topology, vendor: FakeVendor, start_proxy: Any
) -> None:
    limit = {"rate": "1/m", "burst": 10, "max_wait": "0s"}
    a, b = await two_replicas(topology, vendor, start_proxy, rate_limit=limit)
    statuses = [(await search(client)).status for client in (a, b) * 10]
    assert statuses.count(200) == 10 and statuses.count(429) == 10
    assert vendor.count() == 10


async def test_an_entry_one_replica_stored_is_a_hit_on_the_other(
    topology: Topology, vendor: FakeVendor, start_proxy: Any
) -> None:
    a, b = await two_replicas(topology, vendor, start_proxy, cache=CACHE)
    for i in range(5):  # spread over slots, and so over a cluster's masters
        assert (await search(a, f"shared {i}")).headers["X-Cache"] == "MISS"
    for i in range(5):
        assert (await search(b, f"shared {i}")).headers["X-Cache"] == "HIT"
    assert vendor.count() == 5


async def test_a_trip_in_one_replica_holds_the_other(
    topology: Topology, vendor: FakeVendor, start_proxy: Any
) -> None:
    a, b = await two_replicas(topology, vendor, start_proxy, breaker=BREAKER)
    await trip(a, vendor)
    await eventually(lambda: refuses(b), within=3.0, interval=0.05)
    calls = vendor.count()
    assert [await refuses(b) for _ in range(5)] == [True] * 5
    assert vendor.count() == calls


async def test_max_connections_bounds_a_clusters_commands_and_not_a_pipelined_masters(
    topology: Topology,
) -> None:
    """A cluster command holds a connection of its own for its time: with one allowed, a second
    waits its 100 ms and goes in-process (Redis not marked down). A Sentinel master's commands
    share its pipelined connection: none waits for another."""
    routes = {"t": route("https://api.tavily.com", "/t")}
    config = parse_config(
        {"redis": topology.redis() | {"max_connections": 1}, "routes": routes}, {}
    )
    assert config.redis is not None
    events = Busy()
    link = RedisLink(config.redis, config.redis.key_prefix, timeout=0.1, events=events)
    counter = link.key("{held}")  # within the ACL user's keys; one cluster slot
    try:
        assert await link.warm(within=10.0) is True
        release = asyncio.Event()

        async def hold(r: Any) -> Any:
            await release.wait()
            return await r.incr(counter)

        held = asyncio.ensure_future(link.run(hold))
        await asyncio.sleep(0)
        second = await link.run(lambda r: r.incr(counter))
        release.set()
        first = await held
        if topology.name == "cluster":
            assert (second, first, events.busy) == (UNAVAILABLE, 1, 1)
        else:
            assert (second, first, events.busy) == (1, 2, 0)
        assert link.up
    finally:
        await link.close()


async def test_killing_the_master_under_load_fails_nothing_and_sharing_resumes(
    topology: Topology, vendor: FakeVendor, start_proxy: Any
) -> None:
    policies = {"breaker": BREAKER, "cache": CACHE, "rate_limit": {"rate": "1000/s", "burst": 100}}
    a, b = await two_replicas(topology, vendor, start_proxy, **policies)
    links = [client.app[STATE].redis for client in (a, b)]
    statuses: list[int] = []
    loading = True

    async def load(client: Any) -> None:
        while loading:
            statuses.append((await search(client)).status)
            await asyncio.sleep(LOAD_EVERY)

    loads = [asyncio.create_task(load(client)) for client in (a, b)]
    try:
        # Steady load, until both links have seen the master they use.
        await eventually(lambda: all(link.nodes for link in links), within=10.0, interval=0.05)
        before = {address for link in links for address, _ in link.nodes}
        old, new = await asyncio.to_thread(topology.kill_and_wait)
        promoted_at = time.monotonic()

        def moved() -> bool:
            # The link looks at its nodes at most once a second while it answers.
            return all(link.up and new in {addr for addr, _ in link.nodes} for link in links)

        await eventually(moved, within=WITHIN_AFTER_PROMOTION, interval=0.05)
    finally:
        loading = False
        await asyncio.gather(*loads)
    assert len(statuses) > 50 and set(statuses) == {200}, sorted(set(statuses))

    # Both replicas now send to the promoted master, and say so.
    assert old in before
    for client in (a, b):
        metrics = await (await client.get("/metrics")).text()
        failovers = metric_value(metrics, "search_proxy_redis_failovers_total")
        assert failovers >= 1
        assert f'search_proxy_redis_node{{node="{new}",role="master"}} 1.0' in metrics
        assert f'node="{old}"' not in metrics
        assert metric_value(metrics, "search_proxy_redis_degraded_seconds_total") > 0

    await trip(a, vendor)
    left = WITHIN_AFTER_PROMOTION - (time.monotonic() - promoted_at)
    await eventually(lambda: refuses(b), within=left, interval=0.05)

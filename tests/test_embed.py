"""The documented embedding API (proxy/embed.py) and the harness behind the pytest fixture
(proxy/testing/harness.py): a proxy started in-process from a dict or a file on free ports,
reached by a real SDK, stopped with nothing left listening; fake vendors behind each route that a
test makes fail."""

from __future__ import annotations

import asyncio
import socket

import pytest
import tavily
import yaml

from proxy.config import ConfigErrors
from proxy.embed import serve, serve_in_thread
from proxy.testing.harness import DEMO_CONFIG, harness, harness_in_thread
from testkit.fakevendor import FakeVendor, expected_urls
from tests.conftest import route
from tests.test_admin import get_json


def listening(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0


def tavily_search(base: str, query: str) -> list[str]:
    with tavily.TavilyClient(api_key="agent-key", api_base_url=base) as client:
        return [r["url"] for r in client.search(query, max_results=2)["results"]]


async def test_serve_a_dict_on_free_ports_then_stop_listening(vendor: FakeVendor) -> None:
    config = {"routes": {"tavily": route(f"{vendor.url}/tavily", "/tavily")}}
    async with serve(config) as proxy:
        assert proxy.url.startswith("http://127.0.0.1:") and proxy.url != proxy.admin_url
        assert proxy.url_for("tavily") == proxy.url + "/tavily"
        got = await asyncio.to_thread(tavily_search, proxy.url_for("tavily"), "embedded")
        assert got == expected_urls("embedded", 2)
        status, body = await asyncio.to_thread(get_json, f"{proxy.admin_url}/admin/breakers")
        assert status == 200 and body == {"breakers": {}}
        status, body = await asyncio.to_thread(get_json, f"{proxy.url}/admin/breakers")
        assert status == 404 and proxy.admin_url.removeprefix("http://") in str(body)
    assert not listening(proxy.url) and not listening(proxy.admin_url)


async def test_serve_a_file_reading_its_variables_from_env(tmp_path, vendor: FakeVendor) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "routes": {
                    "tavily": route(
                        "${VENDOR}/tavily",
                        "/tavily",
                        headers={"set": {"Authorization": "Bearer ${TAVILY_API_KEY}"}},
                    )
                }
            }
        )
    )
    async with serve(path, env={"VENDOR": vendor.url, "TAVILY_API_KEY": "proxy-key"}) as proxy:
        await asyncio.to_thread(tavily_search, proxy.url_for("tavily"), "from a file")
    assert vendor.last.headers["Authorization"] == "Bearer proxy-key"


async def test_a_bad_config_raises_every_mistake_before_listening() -> None:
    config = {"routes": {"a": {"prefix": "a", "upstream": "ftp://x", "retry": {"attempts": 0}}}}
    with pytest.raises(ConfigErrors) as caught:
        async with serve(config):
            pytest.fail("served a bad config")
    assert [e.path for e in caught.value.errors] == [
        "routes.a.prefix",
        "routes.a.upstream",
        "routes.a.retry.attempts",
    ]


def test_serve_in_thread_serves_synchronous_code() -> None:
    with FakeVendor().start_in_thread() as vendor:  # a sync test runs no loop of its own
        config = {"routes": {"tavily": route(f"{vendor.url}/tavily", "/tavily")}}
        with serve_in_thread(config) as proxy:
            got = tavily_search(proxy.url_for("tavily"), "sync agent")
    assert got == expected_urls("sync agent", 2)
    assert not listening(proxy.url)


def test_serve_in_thread_raises_what_starting_raised() -> None:
    with pytest.raises(ConfigErrors, match="routes: required key is missing"):
        with serve_in_thread({}):
            pytest.fail("served no routes")


async def test_the_harness_swaps_every_upstream_for_a_fake_of_its_own() -> None:
    async with harness(DEMO_CONFIG) as running:
        assert set(running.vendors) == {"tavily", "exa", "brave", "down"}
        for name, r in running.config.routes.items():
            assert r.upstream.startswith("http://127.0.0.1:"), name  # never a real vendor
        got = await asyncio.to_thread(tavily_search, running.url_for("tavily"), "harnessed")
        assert got == expected_urls("harnessed", 2)
        assert running.calls("tavily") == 1 and running.calls("exa") == 0
        # The demo config injects a key of its own, in place of the agent's.
        assert running.requests("tavily")[0].headers["Authorization"] == "Bearer demo-tavily-key"


def test_a_fault_for_some_calls_is_retried_one_until_healed_fails_over() -> None:
    with harness_in_thread(DEMO_CONFIG) as running:
        base = running.url_for("tavily")
        running.fail("tavily", 503, times=1)  # the route retries once
        assert tavily_search(base, "one blip") == expected_urls("one blip", 2)
        assert running.calls("tavily") == 2 and running.calls("exa") == 0

        running.fail("tavily", 503)  # until healed: the route fails over to exa
        assert tavily_search(base, "an outage") == expected_urls("an outage", 2)
        assert running.calls("exa") == 1

        running.heal()
        assert tavily_search(base, "recovered") == expected_urls("recovered", 2)
        assert running.vendor("tavily").last.json()["query"] == "recovered"
        with pytest.raises(KeyError, match="no route 'bing'; routes: tavily, exa, brave, down"):
            running.fail("bing")

"""The pytest plugin installed with the package (its `pytest11` entry point): the `search_proxy`
fixture serves the proxy with a fake vendor behind each route for one test, so an agent's test
suite runs its agent through the proxy without vendor keys or the network, and can make a vendor
fail; `search_proxy_config` chooses what it serves."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from proxy.embed import ConfigSource
from proxy.testing.harness import DEMO_CONFIG, ProxyHarness, harness_in_thread


@pytest.fixture
def search_proxy_config() -> ConfigSource:
    """What `search_proxy` serves: override this fixture (in your conftest.py) with your own
    config, a file or a YAML-shaped dict; its upstreams are replaced by fake vendors. Default:
    the demo's (routes tavily, exa, brave and down, /v1/search, /mcp)."""
    return DEMO_CONFIG


@pytest.fixture
def search_proxy(search_proxy_config: ConfigSource) -> Iterator[ProxyHarness]:
    """The proxy on `search_proxy_config`, with a fake vendor behind each route, for one test:
    `search_proxy.url_for("tavily")` is the base URL an SDK takes, `search_proxy.fail("tavily")`
    makes that vendor answer 503 (proxy/testing/harness.py has the rest). It runs in a thread
    of its own, so sync and async tests alike can call it."""
    with harness_in_thread(search_proxy_config) as running:
        yield running

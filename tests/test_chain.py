"""The chain's registry is the only place a policy is wired: docs/development.md's example
policy, run as its own module and registered with one line, is parsed, checked, printed back and
built into a route, at its place in the chain, through a real proxy on loopback."""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from policies import cache, chain
from proxy.app import STATE
from proxy.config import ConfigErrors, as_document, parse_config
from testkit.fakevendor import FakeVendor
from tests.conftest import route

DEVELOPMENT = Path(__file__).resolve().parent.parent / "docs" / "development.md"


def readme_policy() -> types.ModuleType:
    """docs/development.md's "Adding a policy" module, executed as `policies.stamp`."""
    text = DEVELOPMENT.read_text(encoding="utf-8")
    part = text[text.index("\n## Adding a policy\n") : text.index("\n## Adding a vendor\n")]
    (source,) = re.findall(r"```python\n(.*?)```", part, re.DOTALL)
    module = types.ModuleType("policies.stamp")
    sys.modules[module.__name__] = module
    exec(compile(source, "docs/development.md (policies/stamp.py)", "exec"), module.__dict__)
    return module


@pytest.fixture
def stamp(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """The example policy, registered with the one line the page shows: after the cache."""
    module = readme_policy()
    at = chain.CHAIN.index(cache.LINK) + 1
    monkeypatch.setattr(chain, "CHAIN", (*chain.CHAIN[:at], module.LINK, *chain.CHAIN[at:]))
    yield module
    sys.modules.pop(module.__name__, None)


def stamped(vendor: FakeVendor, **stamp: Any) -> dict[str, Any]:
    return {
        "routes": {
            "t": route(
                vendor.url,
                "/t",
                search={"vendor": "tavily"},
                cache={"ttl": "1m"},
                stamp=stamp,
            )
        }
    }


@pytest.mark.unit
def test_an_unregistered_section_is_an_unknown_key(vendor: FakeVendor) -> None:
    with pytest.raises(ConfigErrors) as info:
        parse_config(stamped(vendor, value="x"), {})
    assert str(info.value).startswith("routes.t.stamp: unknown key (allowed: prefix, upstream")


@pytest.mark.unit
def test_the_registered_section_parses_checks_and_prints_back(
    stamp: types.ModuleType, vendor: FakeVendor
) -> None:
    config = parse_config(stamped(vendor, value="replica-a"), {})
    assert config.routes["t"].section("stamp") == stamp.StampConfig(value="replica-a")
    assert parse_config(as_document(config), {}) == config
    with pytest.raises(ConfigErrors) as info:
        parse_config(stamped(vendor, header="X-Who"), {})
    assert str(info.value) == "routes.t.stamp.value: required key is missing"
    with pytest.raises(ConfigErrors) as info:
        parse_config(stamped(vendor, value="two\nlines"), {})
    assert str(info.value) == "routes.t.stamp.value: expected a one-line string value"


async def test_the_registered_policy_runs_at_its_place_in_the_chain(
    stamp: types.ModuleType, vendor: FakeVendor, start_proxy: Any
) -> None:
    client = await start_proxy(stamped(vendor, value="replica-a", header="X-Served-By"))
    body = {"query": "circuit breakers"}
    first = await client.post("/t/search", json=body)
    assert first.status == 200 and first.headers["X-Served-By"] == "replica-a"
    assert first.headers["X-Cache"] == "MISS"
    # Inside the cache: a hit never reaches it, so the stored answer carries no stamp.
    second = await client.post("/t/search", json=body)
    assert second.headers["X-Cache"] == "HIT" and "X-Served-By" not in second.headers
    assert vendor.count() == 1
    names = [type(p).__name__ for p in client.app[STATE].routes["t"].policies]
    assert names.index("StaleCache") + 1 == names.index("Stamp")

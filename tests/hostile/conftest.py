"""What the hostile-peer modules share: a fake vendor served from a thread for the whole module,
so a proxy process (its own, not the test's loop) can reach it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testkit.fakevendor import FakeVendor


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeVendor]:
    """The fake vendor in a thread of its own; `fake.url` is its origin."""
    vendor = FakeVendor()
    served = vendor.start_in_thread()
    vendor.url = served.url  # type: ignore[attr-defined]
    yield vendor
    served.stop()

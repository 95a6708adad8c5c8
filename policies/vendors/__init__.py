"""The built-in vendors, one module each holding its whole record (a VendorProfile). Adding a
vendor is its module here and two lines below: its import and its place in BUILTIN."""

from __future__ import annotations

from collections.abc import Mapping

from policies.core.profile import VendorProfile
from policies.vendors.brave import BRAVE
from policies.vendors.exa import EXA
from policies.vendors.firecrawl import FIRECRAWL
from policies.vendors.jina import JINA
from policies.vendors.linkup import LINKUP
from policies.vendors.scavio import SCAVIO
from policies.vendors.searxng import SEARXNG
from policies.vendors.serpapi import SERPAPI
from policies.vendors.serper import SERPER
from policies.vendors.tavily import TAVILY

# By name, as `search.vendor` and `extends` name them. Read-only to the proxy (typed Mapping);
# a plain dict, so that a test can register a vendor of its own (monkeypatch.setitem).
BUILTIN: Mapping[str, VendorProfile] = {
    vendor.name: vendor
    for vendor in (
        TAVILY,
        EXA,
        BRAVE,
        SERPER,
        SERPAPI,
        SCAVIO,
        SEARXNG,
        LINKUP,
        JINA,
        FIRECRAWL,
    )
}

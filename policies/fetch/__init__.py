"""Reading the pages an agent chose (/v1/fetch, MCP fetch_page): providers in order with failover
per URL (`engine`) through `readers`, a page cache shared by every caller (`cache`), the URLs
accepted (`pages`), and where the direct fetcher may connect (`addresses`)."""

from policies.fetch.addresses import AddressRules, address_kind, parse_networks
from policies.fetch.cache import LABEL, Cached, PageCache, page_key
from policies.fetch.engine import FetchCall, Fetched, FetchEngine
from policies.fetch.pages import (
    MAX_URL_CHARS,
    PAGE_FORMATS,
    Miss,
    MissKind,
    Page,
    PageFormat,
    canonical_url,
    check_url,
)
from policies.fetch.readers import Asking, Read, Reader, RouteReader, missed_all

__all__ = [
    "LABEL",
    "MAX_URL_CHARS",
    "PAGE_FORMATS",
    "AddressRules",
    "Asking",
    "Cached",
    "FetchCall",
    "FetchEngine",
    "Fetched",
    "Miss",
    "MissKind",
    "Page",
    "PageCache",
    "PageFormat",
    "Read",
    "Reader",
    "RouteReader",
    "address_kind",
    "canonical_url",
    "check_url",
    "missed_all",
    "page_key",
    "parse_networks",
]

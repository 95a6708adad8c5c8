"""A fake web-search vendor: one real aiohttp application that stands in for every vendor.

Tests start it on loopback (``aiohttp_server(vendor.make_app())``, ``await vendor.start()``,
``vendor.start_in_thread()``) or as a separate process (``python -m proxy.testing.fakevendor
--port 0``, or testkit's ``FakeVendorProcess``; bench does that), point the proxy's routes at it
and assert on what it received (``vendor.requests``) and how long it waited (``vendor.pauses``).
It imports nothing of the proxy (an import contract): a fake built from the proxy's own vendor
records would agree with the proxy by construction.

Routes (every vendor is served under ``/<vendor>/...`` and, where paths do not clash, bare):

=========  ===================================================  ==============================
vendor     prefixed path (bare path)                            results
=========  ===================================================  ==============================
tavily     POST /tavily/search  (POST /search, see below)       results[] url/title/content
serper     POST|GET /serper/search  (POST /search)              organic[] title/link/snippet
exa        POST /exa/search  (POST /search with x-api-key)      results[] url/title/text
brave      GET /brave/res/v1/web/search  (/res/v1/web/search)   web.results[] title/url/desc.
serpapi    GET /serpapi/search.json, /serpapi/search            organic_results[] link/title
           (GET /search.json; GET /search with engine/api_key)
scavio     POST /scavio/api/v2/google  (POST /api/v2/google)    organic_results[]
searxng    GET|POST /searxng/search  (GET /search otherwise)    results[] url/title/content
linkup     POST /linkup/v1/search  (POST /v1/search)            results[] url/name/content
jina       POST|GET /jina/, GET /jina/<query>  (POST /)         data[] url/title/description
firecrawl  POST /firecrawl/v2/search  (POST /v2/search)         data.web[] url/title/desc.
=========  ===================================================  ==============================

The extract APIs (Tavily /extract, Exa /contents, Firecrawl /v2/scrape, Jina's reader at
``/jina-reader/``) answer ``make_page(url)`` for each URL asked, in each vendor's shape; a URL
``vendor.fail_page(url, *vendors)`` names fails at those vendors only (module ``pages``).

Bare ``/search`` is decided by what the request carries, first match wins:

1. GET: ``engine`` or ``api_key`` in the query string -> serpapi; ``apiKey`` -> serper;
   otherwise searxng.
2. POST with a form body (``application/x-www-form-urlencoded``) -> searxng.
3. POST with ``q`` in the query string, or a JSON body that has a ``q`` key or is a list
   (Serper batch) -> serper.
4. POST with an ``X-API-KEY`` header: JSON body with a ``query`` key -> exa, else -> serper
   (Exa and Serper both use that header; only Exa sends ``query``).
5. Anything else -> tavily (``query`` in the body, ``Authorization: Bearer`` or ``api_key``).

Other routes: ``/echo`` and ``/echo/...`` (any method) answer JSON describing the request;
``GET /stream`` (chunked octet-stream; ``?echo=Header`` ends each chunk with that request
header's value, a vendor echoing its key in a stream), ``GET /sse`` (text/event-stream),
``POST /mcp`` (MCP streamable HTTP, JSON-RPC answered as SSE); ``GET /__fake__/stats`` and
``POST /__fake__/reset`` (control, never recorded nor faulted). Unknown paths get 404 and are
recorded.

Results are deterministic: ``make_results(query, n)`` gives url ``https://example.com/<slug>/<i>``
for i = 1..n (n = ``FakeVendor(results=3)`` unless the request asks for fewer).

Each request is recorded (``vendor.requests``), then answered by the first matching scripted
fault (FIFO, ``vendor.script(...)``), else by the probabilistic modes in this order: ``down``,
``rate_limit``, Brave quota, ``fail_ratio``, ``hang_ratio``, ``malformed_ratio``,
``empty_when_words_over``; else by the default fault (``Fault.ok()`` unless ``set_default``).

Modules: ``vendors`` (results, each vendor's bodies, which vendor a request is for), ``faults``
(``Fault``, ``Received``, ``Pause``), ``modes`` (the switches and the decision they make, the
clock), ``app`` (``FakeVendor``: state, record, handlers), ``mcp`` (its MCP server's answers),
``pages`` (the extract APIs' answers), ``serve`` (server, thread) and ``__main__`` (the command
line).
"""

from proxy.testing.fakevendor.app import FakeVendor
from proxy.testing.fakevendor.faults import Fault, Pause, Received
from proxy.testing.fakevendor.modes import Clock, RealClock
from proxy.testing.fakevendor.pages import EXTRACT_VENDORS, FakePage, make_page
from proxy.testing.fakevendor.serve import FakeVendorServer, ThreadedFakeVendor
from proxy.testing.fakevendor.vendors import (
    VENDORS,
    FakeResult,
    expected_urls,
    make_results,
    slugify,
)

__all__ = [
    "EXTRACT_VENDORS",
    "VENDORS",
    "Clock",
    "FakePage",
    "FakeResult",
    "FakeVendor",
    "FakeVendorServer",
    "Fault",
    "Pause",
    "RealClock",
    "Received",
    "ThreadedFakeVendor",
    "expected_urls",
    "make_page",
    "make_results",
    "slugify",
]

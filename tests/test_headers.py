"""proxy/headers.py: which of the agent's headers reach the vendor, and which of the vendor's reach
the agent (the hop-by-hop ones, those a sender lists in Connection, the framing aiohttp's decoding
invalidated, any a server may not write), with every other header kept in its order."""

from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy

from proxy import headers as crossing
from proxy.headers import request_headers, response_headers


def headers(*pairs: tuple[str, str]) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(pairs))


def sent(*pairs: tuple[str, str], remove: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    out = request_headers(
        headers(*pairs),
        set_headers=(("Authorization", "Bearer route-key"),),
        remove=remove,
        client_ip="10.0.0.7",
        proto="https",
        request_id="req-1",
    )
    return list(out.items())


def test_the_agent_s_headers_go_on_less_hop_by_hop_listed_and_removed_ones_in_their_order() -> None:
    assert sent(
        ("Host", "proxy.local"),
        ("X-One", "1"),
        ("connection", "Keep-Alive, X-Hop-A"),
        ("CONNECTION", " x-hop-b ,close"),  # a second Connection header lists more
        ("X-Hop-A", "a"),
        ("x-hop-b", "b"),
        ("X-Two", "2"),
        ("Keep-Alive", "timeout=5"),
        ("X-One", "1 again"),  # a repeated header keeps both values, in order
        ("Content-Length", "12"),
        ("Accept-Encoding", "br"),
        ("X-Route-Drops", "x"),
        ("x-route-drops", "y"),
        ("Authorization", "Bearer agent-key"),  # the route's replaces it
        ("X-Forwarded-For", "192.0.2.1"),
        remove=frozenset({"x-route-drops"}),
    ) == [
        ("X-One", "1"),
        ("X-Two", "2"),
        ("X-One", "1 again"),
        ("Authorization", "Bearer route-key"),
        ("X-Forwarded-For", "192.0.2.1, 10.0.0.7"),
        ("X-Forwarded-Proto", "https"),
        ("X-Request-Id", "req-1"),
    ]


def test_an_agent_without_connection_or_forwarding_headers_still_gets_them_added() -> None:
    assert sent(("Content-Type", "application/json")) == [
        ("Content-Type", "application/json"),
        ("Authorization", "Bearer route-key"),
        ("X-Forwarded-For", "10.0.0.7"),
        ("X-Forwarded-Proto", "https"),
        ("X-Request-Id", "req-1"),
    ]


def test_the_vendor_s_headers_come_back_less_framing_hop_by_hop_and_unwritable_ones() -> None:
    out = response_headers(
        headers(
            ("Content-Type", "application/json"),
            ("Content-Length", "99"),
            ("Content-Encoding", "gzip"),
            ("Transfer-Encoding", "chunked"),
            ("Connection", "X-Vendor-Hop"),
            ("X-Vendor-Hop", "dropped"),
            ("X-RateLimit-Remaining", "41"),
            ("X-Bad", "line\nbreak"),  # aiohttp would refuse to write it on
            ("X-Tab", "a\tb"),  # a tab is allowed in a value
            ("Set-Cookie", "a=1"),
            ("Set-Cookie", "b=2"),
        )
    )
    assert list(out.items()) == [
        ("Content-Type", "application/json"),
        ("X-RateLimit-Remaining", "41"),
        ("X-Tab", "a\tb"),
        ("Set-Cookie", "a=1"),
        ("Set-Cookie", "b=2"),
    ]


def test_printable_vendor_headers_come_back_as_they_were_sent() -> None:
    sent_back = [("Content-Type", "application/json"), ("Date", "Sun, 29 Nov 2026 07:00:00 GMT")]
    assert list(response_headers(headers(*sent_back)).items()) == sent_back


def test_only_short_connection_values_are_remembered_between_requests() -> None:
    """A peer's Connection values are parsed once when short; a long one (up to 128 headers of
    8 KB each) is parsed and let go, so peers cannot fill the memory with them."""
    crossing._short_tokens.cache_clear()
    long_value = ", ".join(f"X-Hop-{i}" for i in range(1000))
    assert len(long_value) > crossing.SHORT_VALUE
    listed = sent(("Connection", long_value), ("X-Hop-999", "dropped"), ("X-Kept", "1"))
    assert ("X-Kept", "1") in listed and all(name != "X-Hop-999" for name, _ in listed)
    for i in range(2 * crossing.TOKENS_KEPT):
        sent(("Connection", f"close, X-{i}"))
    info = crossing._short_tokens.cache_info()
    assert info.currsize == crossing.TOKENS_KEPT  # bounded in entries, each at most SHORT_VALUE
    sent(("Connection", "keep-alive"), ("Keep-Alive", "timeout=5"))
    sent(("Connection", "keep-alive"), ("Keep-Alive", "timeout=5"))
    assert crossing._short_tokens.cache_info().hits == info.hits + 1

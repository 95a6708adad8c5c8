"""Which headers cross the proxy: the agent's that go on to the vendor, and the vendor's that go
back to the agent. Hop-by-hop headers (and those a sender lists in its Connection header) stop
here, as does what the proxy writes itself; every other header keeps its place."""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

from multidict import CIMultiDict, CIMultiDictProxy, MultiMapping

from policies.core.route import HOP_BY_HOP, PROXY_OWNED

# Never copied from the agent: the proxy writes Host from the route's upstream and frames the
# body itself, and it negotiates its own Accept-Encoding so it can decode what the vendor sends.
_REQUEST_DROP = PROXY_OWNED
# aiohttp decodes compressed bodies, so the vendor's framing headers no longer describe them.
_RESPONSE_DROP = HOP_BY_HOP | {"content-length", "content-encoding"}
# What aiohttp's server refuses in a header it writes (HTAB is allowed in field values).
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _connection_listed(headers: MultiMapping[str]) -> frozenset[str]:
    """Header names the sender declared hop-by-hop in its Connection header."""
    values = headers.getall("Connection", ())
    if len(values) == 1:
        return _tokens(values[0])
    return frozenset().union(*map(_tokens, values))


# A Connection value as short as this (`keep-alive`, `close`, `Upgrade, HTTP2-Settings`) has its
# tokens remembered: the values a peer sends repeat. A longer one is parsed each time, so what
# the memory holds is at most TOKENS_KEPT short strings, whatever peers send.
SHORT_VALUE = 64
TOKENS_KEPT = 256


def _tokens(value: str) -> frozenset[str]:
    return _short_tokens(value) if len(value) <= SHORT_VALUE else _parse_tokens(value)


def _parse_tokens(value: str) -> frozenset[str]:
    return frozenset(token.strip().lower() for token in value.split(","))


_short_tokens = lru_cache(maxsize=TOKENS_KEPT)(_parse_tokens)


def _drop(headers: CIMultiDict[str], names: Iterable[str]) -> None:
    """Remove every value of each of `names` (lower case); a lookup per name is cheaper than
    lowering every header's name."""
    for name in names:
        if name in headers:
            del headers[name]


def request_headers(
    incoming: CIMultiDictProxy[str],
    *,
    set_headers: Iterable[tuple[str, str]],
    remove: frozenset[str],
    client_ip: str | None,
    proto: str,
    request_id: str,
) -> CIMultiDict[str]:
    """Outbound headers: the agent's, less hop-by-hop and removed ones, plus the route's."""
    out = incoming.copy()
    for names in (_REQUEST_DROP, remove, _connection_listed(incoming)):
        _drop(out, names)
    for name, value in set_headers:
        out[name] = value
    if client_ip:
        prior = incoming.get("X-Forwarded-For")
        out["X-Forwarded-For"] = f"{prior}, {client_ip}" if prior else client_ip
    out["X-Forwarded-Proto"] = proto
    out["X-Request-Id"] = request_id
    return out


def response_headers(upstream: MultiMapping[str]) -> CIMultiDict[str]:
    """The vendor's headers less hop-by-hop, the framing aiohttp's decoding invalidated, and
    any with a control character (aiohttp reads them, but refuses to write them on)."""
    out = CIMultiDict(upstream)
    for names in (_RESPONSE_DROP, _connection_listed(upstream)):
        _drop(out, names)
    if all(k.isprintable() and v.isprintable() for k, v in out.items()):
        return out
    return CIMultiDict((k, v) for k, v in out.items() if _clean(k) and _clean(v))


def _clean(text: str) -> bool:
    """No control character but tab; a printable string (the usual case) is not searched."""
    return text.isprintable() or not _CONTROL.search(text)

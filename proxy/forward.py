"""Forwarding one attempt to a route's upstream over the process's pooled ClientSession.

The upstream URL is built from the route's configured scheme, host and port, never from the
request, so nothing a caller sends can steer a request to another host.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from policies.backoff import attempt_timeout
from policies.core.clock import Clock
from policies.core.errors import (
    DeadlineExceeded,
    UpstreamTimeout,
    UpstreamUnreachable,
    seconds_text,
)
from policies.core.flow import Flow, Reply
from policies.core.outcome import Outcome
from proxy.config import RouteConfig

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "proxy-authenticate",
        "proxy-authorization",
    }
)
# Never copied from the agent: aiohttp derives Host from the URL and frames the body itself,
# and it negotiates its own Accept-Encoding so it can decode what the vendor sends.
_REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "accept-encoding", "expect"}
# aiohttp decodes compressed bodies, so the vendor's framing headers no longer describe them.
_RESPONSE_DROP = HOP_BY_HOP | {"content-length", "content-encoding"}
STREAM_TYPES = ("text/event-stream", "application/x-ndjson", "application/stream+json")


def _connection_listed(headers: CIMultiDictProxy[str]) -> set[str]:
    """Header names the sender declared hop-by-hop in its Connection header."""
    listed: set[str] = set()
    for value in headers.getall("Connection", ()):
        listed.update(token.strip().lower() for token in value.split(","))
    return listed


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
    drop = _REQUEST_DROP | remove | _connection_listed(incoming)
    out: CIMultiDict[str] = CIMultiDict(
        (k, v) for k, v in incoming.items() if k.lower() not in drop
    )
    for name, value in set_headers:
        out[name] = value
    if client_ip:
        prior = incoming.get("X-Forwarded-For")
        out["X-Forwarded-For"] = f"{prior}, {client_ip}" if prior else client_ip
    out["X-Forwarded-Proto"] = proto
    out["X-Request-Id"] = request_id
    return out


def response_headers(upstream: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """The vendor's headers less hop-by-hop and the framing aiohttp's decoding invalidated."""
    drop = _RESPONSE_DROP | _connection_listed(upstream)
    return CIMultiDict((k, v) for k, v in upstream.items() if k.lower() not in drop)


def is_stream(resp: aiohttp.ClientResponse) -> bool:
    """Stream event streams, and chunked bodies that are not JSON; buffer everything else.

    JSON answers are read whole so the cache and search recovery can inspect them.
    """
    ctype = resp.content_type
    if ctype in STREAM_TYPES:
        return True
    return resp.content_length is None and "json" not in ctype and resp.method != "HEAD"


class Upstream:
    """The end of a route's chain: one HTTP attempt against the configured upstream."""

    def __init__(
        self,
        route: RouteConfig,
        session: aiohttp.ClientSession,
        clock: Clock,
        observe: Callable[[float], None] | None = None,
    ) -> None:
        base = URL(route.upstream)
        self.observe = observe
        self.route = route.name
        self.session = session
        self.clock = clock
        if base.host is None:
            raise ValueError(f"{route.name}: upstream {route.upstream!r} has no host")
        self.scheme, self.host, self.port = base.scheme, base.host, base.explicit_port
        self.base_path = base.raw_path.rstrip("/")
        self.per_try = route.timeouts.per_try
        self.total = route.timeouts.total
        self.connect = route.timeouts.connect

    def url(self, flow: Flow) -> URL:
        """The upstream URL for a flow: the route's origin, base path and the confined path."""
        path = self.base_path + flow.path
        return URL.build(
            scheme=self.scheme,
            host=self.host,
            port=self.port,
            path=path or "/",
            query_string=flow.query_string,
            encoded=True,
        )

    async def __call__(self, flow: Flow) -> Reply:
        now = self.clock.now()
        budget = attempt_timeout(now, flow.deadline, self.per_try)
        if budget <= 0:
            raise DeadlineExceeded(
                f"{self.route}: total deadline of {seconds_text(self.total)} exceeded after "
                f"{flow.attempts} attempt(s); try again shortly",
                route=self.route,
                attempts=flow.attempts,
            )
        flow.attempts += 1
        timeout = aiohttp.ClientTimeout(total=None, connect=self.connect, sock_read=self.per_try)
        resp: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(budget):
                resp = await self.session.request(
                    flow.method,
                    self.url(flow),
                    headers=flow.headers,
                    data=flow.body or None,
                    timeout=timeout,
                    allow_redirects=False,
                )
                headers = response_headers(resp.headers)
                if is_stream(resp):
                    return Reply(
                        resp.status,
                        headers,
                        stream=resp.content.iter_any(),
                        release=resp.release,
                    )
                body = await resp.read()
                return Reply(resp.status, headers, body)
        except TimeoutError:
            if resp is not None:
                resp.close()
            raise self._timeout(flow, budget) from None
        except aiohttp.ClientConnectorDNSError as exc:
            raise UpstreamUnreachable(
                f"{self.route}: the upstream host {self.host} does not resolve "
                f"({exc.os_error.strerror or exc}); this is the proxy's DNS or its route "
                f"config, not a passing fault: retrying will not help; check the route's "
                "upstream and the proxy's DNS, or use another provider",
                route=self.route,
                attempts=flow.attempts,
                outcome=Outcome.CONNECT_ERROR,
                transient=False,
                reason=f"host {self.host} does not resolve",
            ) from None
        except (aiohttp.ClientConnectorCertificateError, aiohttp.ClientConnectorSSLError) as exc:
            raise UpstreamUnreachable(
                f"{self.route}: the TLS handshake with the upstream {self.host} failed "
                f"({type(exc).__name__}); retrying will not help; check the route's upstream "
                "scheme and port and the proxy's CA certificates, or use another provider",
                route=self.route,
                attempts=flow.attempts,
                outcome=Outcome.CONNECT_ERROR,
                transient=False,
                reason=f"TLS with {self.host} failed",
            ) from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamUnreachable(
                f"{self.route}: cannot connect to the upstream ({exc.os_error.strerror or exc}) "
                f"{self._attempt_text(flow)}; try again shortly or use another provider",
                route=self.route,
                attempts=flow.attempts,
                outcome=Outcome.CONNECT_ERROR,
            ) from None
        except aiohttp.ClientResponseError as exc:
            # Broken framing or headers from the vendor (bad status line, chunk size ...).
            if resp is not None:
                resp.close()
            raise UpstreamUnreachable(
                f"{self.route}: the upstream sent a response the proxy cannot parse "
                f"({type(exc).__name__}: {exc.message[:80]}) {self._attempt_text(flow)}; "
                "try again shortly or use another provider",
                route=self.route,
                attempts=flow.attempts,
                outcome=Outcome.RESET,
                reason="sent a broken response",
            ) from None
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            # After a connection was made (connect failures are caught above): disconnects,
            # resets while sending or reading (ClientConnectionResetError is no ClientOSError).
            if resp is not None:
                resp.close()
            raise UpstreamUnreachable(
                f"{self.route}: the upstream closed the connection before a complete answer "
                f"({type(exc).__name__}) {self._attempt_text(flow)}; try again shortly",
                route=self.route,
                attempts=flow.attempts,
                outcome=Outcome.RESET,
            ) from None
        finally:
            elapsed = self.clock.now() - now
            flow.upstream_seconds += elapsed
            if self.observe is not None:
                self.observe(elapsed)

    def _attempt_text(self, flow: Flow) -> str:
        return f"(attempt {flow.attempts} of {flow.max_attempts})"

    def _timeout(self, flow: Flow, budget: float) -> Exception:
        if budget < self.per_try:
            return DeadlineExceeded(
                f"{self.route}: total deadline of {seconds_text(self.total)} exceeded "
                f"{self._attempt_text(flow)}; try again shortly",
                route=self.route,
                attempts=flow.attempts,
            )
        return UpstreamTimeout(
            f"{self.route}: upstream timed out after {seconds_text(self.per_try)} "
            f"{self._attempt_text(flow)}; try again shortly",
            route=self.route,
            attempts=flow.attempts,
            reason=f"timed out after {seconds_text(self.per_try)}",
        )

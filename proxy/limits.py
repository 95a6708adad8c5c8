"""What the connection limits answer, whichever protocol serves the connection (the front's
AgentConnection, proxy/front.py, or aiohttp's ClientConnection, proxy/guard.py): the refusals
written at accept time and the timeouts of a late head or body, prebuilt once from
ServerConfig, since timers and accepts have no request object to answer through."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import structlog

from policies.core.errors import ProxyError, seconds_text
from proxy.config import ServerConfig
from proxy.dialects import error_body, reason_phrase
from proxy.errors import RequestTimeout, TooManyConnections

log = structlog.get_logger("search_proxy")


def raw_answer(err: ProxyError) -> bytes:
    """A whole HTTP/1.1 response carrying `err` (then close), to write straight to a transport
    when no request object exists to answer through."""
    body = orjson.dumps(error_body(err, "", None))
    head = [
        f"HTTP/1.1 {err.status} {reason_phrase(err)}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        f"X-Proxy-Error: {err.type}",
        *(f"{name}: {value}" for name, value in err.response_headers().items()),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


def log_refusal(request: Any, rid: str | None, err: ProxyError) -> None:
    """The access-log line of a request the connection layer answered itself (`request`, with
    its method and path, is None when it could not be parsed)."""
    log.info(
        "request",
        request_id=rid,
        route=None,
        method=request.method if request is not None else None,
        path=request.path if request is not None else None,
        status=err.status,
        error=err.type,
        reason=err.message,
    )


def _too_many(what: str) -> bytes:
    """The prebuilt answer of a connection refused at accept time because `what`."""
    err = TooManyConnections(f"{what}; retry shortly, and reuse connections", retry_after_s=1.0)
    return raw_answer(err)


def _not_whole(limits: ServerConfig) -> RequestTimeout:
    return RequestTimeout(
        f"the request did not arrive whole within {seconds_text(limits.request_timeout)} "
        "(server.request_timeout); send the request line, headers and whole body at once"
    )


class LimitAnswers:
    """The answers of one listener's limits (`per_peer`: its max_connections_per_peer)."""

    def __init__(self, limits: ServerConfig, per_peer: int) -> None:
        self.limits = limits
        self.refusal = _too_many(
            f"the proxy has {limits.max_connections} connections open (server.max_connections)"
        )
        self.peer_refusal = _too_many(
            f"this address has {per_peer} connections open to the proxy "
            "(server.max_connections_per_peer)"
        )
        # A head is due by the sooner of header_timeout and request_timeout: the answer names it.
        self.head_within = min(limits.header_timeout, limits.request_timeout)
        if limits.request_timeout < limits.header_timeout:
            self._head_late_error = _not_whole(limits)
        else:
            self._head_late_error = RequestTimeout(
                f"the request head did not arrive within {seconds_text(limits.header_timeout)} "
                "(server.header_timeout); send the request line and headers at once"
            )
        self._head_late = raw_answer(self._head_late_error)

    def head_late(self, transport: asyncio.Transport) -> None:
        """Answer a request whose head began but did not arrive in time (then close)."""
        transport.write(self._head_late)
        log_refusal(None, None, self._head_late_error)

    def body_deadlines(
        self, now: float, paused: bool, body_deadline: float, request_deadline: float
    ) -> tuple[float, float]:
        """A body's two deadlines (the next piece's, the whole request's), pushed on past
        `now` while the proxy holds the body back (`paused`: its handler has not read what
        came): neither limit runs out on the agent for the proxy's wait."""
        if not paused:
            return body_deadline, request_deadline
        pushed = now + self.limits.body_timeout
        return max(body_deadline, pushed), max(request_deadline, pushed)

    def body_late(self, *, whole_late: bool) -> RequestTimeout:
        """The error of a body that stalled (or, `whole_late`, of a request not whole by
        request_timeout), for its handler's read to raise."""
        if whole_late:
            return _not_whole(self.limits)
        return RequestTimeout(
            f"the request body stalled: nothing arrived for "
            f"{seconds_text(self.limits.body_timeout)} (server.body_timeout); send the "
            "whole body without pausing"
        )

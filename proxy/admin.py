"""Operator endpoints: breaker state and reset, cache purge, on a listener of their own
(`server.admin_host`:`server.admin_port`, loopback by default), never on the agents' port.

With `server.admin_token` set (or SEARCH_PROXY_ADMIN_TOKEN in the environment), every admin
call needs `Authorization: Bearer <token>`. Without a token, only loopback callers may use them,
and only as themselves: the Host a loopback name (or one of `server.admin_names`), a browser
page only the listener's own (its Origin that Host), and a call that changes something only
with a JSON body or an X-Requested-By header, which no cross-site form can send. The proxy
refuses to start with admin_host off loopback without a token, and refuses a guessable token.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Awaitable, Callable, Mapping

import orjson
from aiohttp import web

from policies.breaker import Breaker
from policies.cache import StaleCache
from policies.core.errors import ProxyError
from proxy.clients import hostname, is_loopback_host, token_problem
from proxy.config import ConfigError, ConfigErrors, ServerConfig
from proxy.dialects import error_response
from proxy.errors import Forbidden, NotFound, Unauthorized
from proxy.pipeline import Route

TOKEN_ENV = "SEARCH_PROXY_ADMIN_TOKEN"
AdminHandler = Callable[[web.Request], Awaitable[web.Response]]


def admin_token(server: ServerConfig, env: Mapping[str, str] = os.environ) -> str | None:
    """The admin token in force: server.admin_token, else SEARCH_PROXY_ADMIN_TOKEN. A weak
    one, or an admin_host off loopback without one, is a ConfigError (start-up refuses it)."""
    token = server.admin_token or env.get(TOKEN_ENV) or None
    errors = []
    problem = token_problem(token) if token is not None else None
    if problem is not None:
        errors.append(
            ConfigError("server.admin_token" if server.admin_token else TOKEN_ENV, problem)
        )
    if token is None and not is_loopback_host(server.admin_host):
        errors.append(
            ConfigError(
                "server.admin_host",
                f"{server.admin_host} is not a loopback address and no admin token is set: "
                "anyone reaching it could purge caches and reset breakers; set "
                f"server.admin_token (or {TOKEN_ENV}), or keep admin_host on 127.0.0.1",
            )
        )
    if errors:
        raise ConfigErrors(errors)
    return token


def _is_loopback(remote: str | None) -> bool:
    try:
        return remote is not None and ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False


# Methods that only read; any other changes something and must not come from a simple form.
READING = frozenset({"GET", "HEAD", "OPTIONS"})
# A header no cross-site form or simple request can carry: curl -H 'X-Requested-By: me'.
REQUESTED_BY = "X-Requested-By"


def authorize(
    remote: str | None,
    authorization: str,
    token: str | None,
    *,
    host: str | None = None,
    origin: str | None = None,
    method: str = "GET",
    content_type: str = "",
    requested_by: bool = False,
    names: frozenset[str] = frozenset(),
) -> None:
    """Raise Unauthorized unless this caller may use the admin endpoints (a pure decision).
    Without a token, a loopback caller must also name a loopback `host` (or one of `names`);
    a browser page (`origin`) must be the listener's own, its authority that Host; and a call
    that changes something needs a JSON `content_type` or `requested_by`. A page elsewhere,
    its name rebound to 127.0.0.1 (DNS rebinding) or posting across sites, is Forbidden."""
    if token:
        given = authorization.removeprefix("Bearer ").strip()
        # surrogateescape: a token sent in bytes that are not UTF-8 is a wrong token, not a 500.
        if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode()):
            raise Unauthorized("admin endpoints need Authorization: Bearer <server.admin_token>")
        return
    if not _is_loopback(remote):
        raise Unauthorized(
            "admin endpoints are open to loopback callers only; set server.admin_token "
            f"(or {TOKEN_ENV}) to use them from elsewhere"
        )
    name = hostname(host) if host is not None else None
    if name is not None and not is_loopback_host(name) and name.lower() not in names:
        raise Forbidden(
            f"without server.admin_token the admin endpoints answer loopback names only (and "
            f"server.admin_names), not {name!r}: open http://127.0.0.1:<admin_port>/ or set "
            "an admin token"
        )
    if origin is not None and origin.partition("://")[2].lower() != (host or "").lower():
        raise Forbidden(
            "without server.admin_token the admin endpoints answer their own page only, not a "
            f"page from {origin[:100]!r}: open http://127.0.0.1:<admin_port>/ or set an admin "
            "token"
        )
    json_body = content_type.partition(";")[0].strip().lower() == "application/json"
    if method not in READING and not (json_body or requested_by):
        raise Forbidden(
            f"{method} changes something: send it with Content-Type: application/json or an "
            f"{REQUESTED_BY} header (no cross-site form can), e.g. curl -X {method} -H "
            f"'{REQUESTED_BY}: me' ..."
        )


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


class Admin:
    """The admin handlers over the running routes."""

    def __init__(
        self, routes: dict[str, Route], token: str | None, names: tuple[str, ...] = ()
    ) -> None:
        self.routes = routes
        self.token = token or os.environ.get(TOKEN_ENV) or None
        self.names = frozenset(name.lower() for name in names)  # server.admin_names
        # Named like the resources registered in proxy/app.py.
        self._handlers: dict[str, AdminHandler] = {
            "breakers": self.breakers,
            "reset_breaker": self.reset_breaker,
            "clear_cache": self.clear_cache,
        }

    def _missing(self, name: str, need: str) -> NotFound:
        having = sorted(n for n, r in self.routes.items() if getattr(r, need) is not None)
        return NotFound(f"no route {name!r} with a {need}; routes with one: {having}")

    def _breaker(self, request: web.Request) -> tuple[str, Breaker]:
        name = request.match_info["route"]
        route = self.routes.get(name)
        if route is None or route.breaker is None:
            raise self._missing(name, "breaker")
        return name, route.breaker

    def _cache(self, request: web.Request) -> tuple[str, StaleCache]:
        name = request.match_info["route"]
        route = self.routes.get(name)
        if route is None or route.cache is None:
            raise self._missing(name, "cache")
        return name, route.cache

    async def dispatch(self, request: web.Request) -> web.Response:
        """Authorize, then run the handler named by the matched resource; errors as JSON."""
        return await self.answer(request, self._handlers[request.match_info.route.name or ""])

    async def answer(self, request: web.Request, handler: AdminHandler) -> web.Response:
        """Authorize the caller, then answer with `handler`; errors as JSON."""
        try:
            headers = request.headers
            authorize(
                request.remote,
                headers.get("Authorization", ""),
                self.token,
                host=headers.get("Host"),
                origin=headers.get("Origin"),
                method=request.method,
                content_type=headers.get("Content-Type", ""),
                requested_by=REQUESTED_BY in headers,
                names=self.names,
            )
            return await handler(request)
        except ProxyError as err:
            return error_response(err, request.headers.get("X-Request-Id", ""))

    async def breakers(self, request: web.Request) -> web.Response:
        """GET /admin/breakers: every breaker's state and time to half-open."""
        body = {
            name: {
                "state": route.breaker.state,
                "retry_in_s": round(route.breaker.seconds_until_half_open(), 3),
            }
            for name, route in self.routes.items()
            if route.breaker is not None
        }
        return _json({"breakers": body})

    async def reset_breaker(self, request: web.Request) -> web.Response:
        """POST /admin/breakers/{route}/reset: close it here and, with Redis, everywhere."""
        name, breaker = self._breaker(request)
        await breaker.reset()
        return _json({"route": name, "state": breaker.state})

    async def clear_cache(self, request: web.Request) -> web.Response:
        """DELETE /admin/cache/{route}: drop the route's entries here and in Redis."""
        name, cache = self._cache(request)
        cleared = await cache.clear()
        return _json({"route": name, "local": cleared.local, "shared": cleared.shared})

"""Known clients (`clients:`): who is calling, by its token, and whether its day has room left.

An agent sends its client token where its SDK sends the vendor's API key (the route profile's
credential slot: `Authorization: Bearer`, `x-api-key`, `X-Subscription-Token`, `api_key=`, and
the JSON body fields it reads one from, Tavily's `api_key`), or as `Authorization: Bearer
<token>` on any route and on /v1/search. The proxy recognises it,
scrubs it from the request and sends the route's own key (`headers.set`), so an agent's config
holds no vendor key. Without a known token a request is refused (401) before any vendor call,
any rate-limit bucket or any quota count.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from urllib.parse import parse_qsl, unquote_plus

from multidict import CIMultiDictProxy

from policies.core.errors import QuotaExceeded
from policies.core.flow import Request
from policies.profiles import (
    CredentialSlot,
    VendorProfile,
    body_keys,
    with_body_key,
)
from policies.quota import DailyQuota
from proxy.config import ClientConfig, ConfigError, ConfigErrors
from proxy.errors import Unauthorized
from proxy.metrics import Metrics
from proxy.pipeline import Route

MIN_TOKEN_CHARS = 16
_VISIBLE_ASCII = re.compile(r"^[\x21-\x7e]+$")  # one header value: no spaces, no controls
# Where a token is looked for besides the vendor's own slot: every route and /v1/search.
BEARER = CredentialSlot("header", "Authorization", "Bearer ")
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="search-proxy"'}


def token_problem(token: str) -> str | None:
    """Why `token` is too weak to guard anything (None: it will do). Never quotes the token."""
    why: str | None = f"must be at least {MIN_TOKEN_CHARS} visible ASCII characters without spaces"
    if len(token) >= MIN_TOKEN_CHARS and _VISIBLE_ASCII.match(token):
        why = guessable(token)
    return None if why is None else f"{why}; generate one with `{GENERATOR}`"


GENERATOR = "openssl rand -hex 32"
# Words that make a token a placeholder, a default or the first guess: none turns up in a
# generated one (a 64-character hex or base64 token holds any of them with odds below 1e-6).
GUESSED_WORDS = (
    "replace",
    "change",
    "example",
    "placeholder",
    "generate",
    "your",
    "insert",
    "dummy",
    "sample",
    "default",
    "password",
    "passw0rd",
    "secret",
    "token",
    "admin",
    "local",
    "qwerty",
    "letmein",
    "welcome",
)
MIN_DISTINCT = 6  # a 16-character hex token has about 10
# A word (lower case or Capitalised, not all hex letters) and a number, either way round, maybe
# with one symbol after: `sunshine12345678`, `2024Springtime!`.
_WORD = r"[A-Z]?[a-z]*[g-z][a-z]*"
_WORD_AND_NUMBER = re.compile(rf"^(?:{_WORD}[0-9]+|[0-9]+{_WORD})[^A-Za-z0-9]?$")


def guessable(token: str) -> str | None:
    """Why a token of the right length is still guessable: a placeholder or a common word, a
    word and a number, or mostly repeated or sequential characters; None when it is not."""
    if any(form in token for w in GUESSED_WORDS for form in (w, w.upper(), w.capitalize())):
        return "looks like a placeholder, a default or a common word, not a generated token"
    if _WORD_AND_NUMBER.match(token):
        return "is a word and a number, not a generated token"
    if len(set(token)) < MIN_DISTINCT or 2 * _unpatterned(token) < len(token):
        return "is mostly repeated or sequential characters, not a generated token"
    return None


def _unpatterned(token: str) -> int:
    """How many characters of `token` are outside runs of 3+ of one character and runs of 4+
    characters each one up or down from the one before (`aaa`, `1234`, `fedc`): a guessable
    token is mostly such runs, a generated one has few."""
    n, kept, i = len(token), 0, 0
    while i < n:
        run = 1
        step = ord(token[i + 1]) - ord(token[i]) if i + 1 < n else 0
        while i + run < n and ord(token[i + run]) - ord(token[i + run - 1]) == step:
            run += 1
        patterned = (step == 0 and run >= 3) or (abs(step) == 1 and run >= 4)
        if patterned:
            i += run
        else:
            kept += 1
            i += 1
    return kept


def is_loopback_host(host: str) -> bool:
    """Whether a listen address reaches this machine only (`localhost` counts, a name doesn't)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def hostname(authority: str) -> str:
    """The host of a Host header or an Origin's authority: `[::1]:8080` -> `::1`."""
    if authority.startswith("["):
        return authority[1 : authority.find("]")] if "]" in authority else ""
    return authority.rsplit(":", 1)[0] if authority.count(":") == 1 else authority


def foreign_page(origin: str) -> str | None:
    """The host of a web page (a request's `Origin`) that is not on this machine, for the error
    that refuses it; None for a page on a loopback host (`*.localhost` included: browsers
    resolve it to loopback themselves, so it cannot be rebound) or not on the web at all (an
    extension's or an app's own: `chrome-extension:`, `vscode-webview:`, `file:` ...). "null" (a
    sandboxed page, which any site can make) is refused."""
    scheme, sep, rest = origin.partition("://")
    if sep and scheme.lower() not in ("http", "https"):
        return None
    page = hostname(rest.split("/", 1)[0]).lower()
    if is_loopback_host(page) or page.endswith(".localhost"):
        return None
    return page or origin


def without_param(query_string: str, name: str, value: str) -> str:
    """`query_string` less its `name=value` pairs (compared decoded); every other pair as sent."""
    kept = []
    for pair in query_string.split("&") if query_string else ():
        key, _, val = pair.partition("=")
        if unquote_plus(key) != name or unquote_plus(val) != value:
            kept.append(pair)
    return "&".join(kept)


def _unprefixed(value: str, prefix: str) -> str | None:
    """The token in a header value: after the scheme prefix (any case), if the slot has one."""
    if prefix:
        if value[: len(prefix)].lower() != prefix.lower():
            return None
        value = value[len(prefix) :]
    return value.strip() or None


def presented(
    slot: CredentialSlot | None, headers: CIMultiDictProxy[str], query_string: str
) -> Iterator[tuple[CredentialSlot, str, str]]:
    """Every (slot, value as sent, candidate token) of a request: the vendor's slot, then
    `Authorization: Bearer`."""
    for where in (slot, BEARER) if slot is not None and slot != BEARER else (BEARER,):
        if where.kind == "header":
            for value in headers.getall(where.name, ()):
                token = _unprefixed(value, where.prefix)
                if token is not None:
                    yield where, value, token
        elif query_string:
            for key, value in parse_qsl(query_string, keep_blank_values=True):
                if key == where.name and value:
                    yield where, value, value


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "replace")).digest()


def _where_text(slot: CredentialSlot | None) -> str:
    if slot is None or slot == BEARER:
        return "Authorization: Bearer <token>"
    if slot.kind == "query":
        return f"the {slot.name} query parameter, or Authorization: Bearer <token>"
    return f"{slot.name}: {slot.prefix}<token>, or Authorization: Bearer <token>"


@dataclass(frozen=True, slots=True)
class Caller:
    """A recognised client, and where its token sits in the request (so it can be scrubbed)."""

    name: str
    headers: tuple[tuple[str, str], ...] = ()  # (header, the exact value that carried it)
    params: tuple[tuple[str, str], ...] = ()  # (query parameter, its decoded value)
    fields: tuple[str, ...] = ()  # top-level JSON body fields that carried it

    def scrub(self, request: Request) -> Request:
        """The outbound request without the token. A value the route set since (its own key
        in the same header) differs from what the agent sent, and stays."""
        if self.fields:
            request = replace(request, body=with_body_key(request.body, self.fields, None))
        for name, value in self.headers:
            values = request.headers.getall(name, [])
            if value in values:
                request.headers.popall(name)
                for kept in values:
                    if kept != value:
                        request.headers.add(name, kept)
        query_string = request.query_string
        for name, value in self.params:
            query_string = without_param(query_string, name, value)
        return replace(request, query_string=query_string)


class ClientGate:
    """Recognises configured clients by their tokens and spends their daily quotas; built once
    at start-up. Tokens are kept only as digests. A weak or shared token is a ConfigError."""

    def __init__(
        self, clients: Mapping[str, ClientConfig], quota: DailyQuota, metrics: Metrics
    ) -> None:
        self.quota = quota
        self.metrics = metrics
        self._by_digest: dict[bytes, str] = {}
        errors = []
        for name, client in clients.items():
            where = f"clients.{name}.token"
            problem = token_problem(client.token)
            digest = _digest(client.token)
            if problem is not None:
                errors.append(ConfigError(where, problem))
            elif digest in self._by_digest:
                other = self._by_digest[digest]
                errors.append(
                    ConfigError(where, f"is client {other!r}'s token too: give each its own")
                )
            else:
                self._by_digest[digest] = name
        if errors:
            raise ConfigErrors(errors)

    def identify(
        self,
        profile: VendorProfile | None,
        headers: CIMultiDictProxy[str],
        query_string: str,
        body: bytes = b"",
    ) -> Caller:
        """The caller whose token the request carries (in `profile`'s credential slot, its
        body's key fields, or as a bearer token); Unauthorized without one. Every place that
        carried a known token is recorded, to be scrubbed."""
        slot = profile.key_slot if profile is not None else None
        name: str | None = None
        carrying_headers: list[tuple[str, str]] = []
        carrying_params: list[tuple[str, str]] = []
        for where, value, token in presented(slot, headers, query_string):
            known = self._by_digest.get(_digest(token))
            if known is None:
                continue
            name = name or known
            carrying = carrying_headers if where.kind == "header" else carrying_params
            carrying.append((where.name, value))
        fields = profile.key_fields if profile is not None else ()
        carrying_fields = []
        for field_name, token in body_keys(body, fields).items():
            known = self._by_digest.get(_digest(token))
            if known is not None:
                name = name or known
                carrying_fields.append(field_name)
        if name is None:
            self.metrics.clients_refused.labels("unknown_token").inc()
            raise Unauthorized(
                "search-proxy serves known clients only, and this request carries no known "
                "client token: send the token you were given where the SDK sends its API key "
                f"({_where_text(slot)})",
                headers=CHALLENGE,
            )
        return Caller(name, tuple(carrying_headers), tuple(carrying_params), tuple(carrying_fields))

    async def admit(
        self,
        profile: VendorProfile | None,
        headers: CIMultiDictProxy[str],
        query_string: str,
        body: bytes = b"",
    ) -> Caller:
        """`identify`, then count the request against the caller's daily quota (QuotaExceeded
        past it, with the time until the day ends)."""
        caller = self.identify(profile, headers, query_string, body)
        await self.spend(caller.name)
        return caller

    async def spend(self, name: str) -> None:
        """Count one request of client `name` against its daily quota (QuotaExceeded past it).
        The MCP server identifies a caller per HTTP request but spends per tool call."""
        try:
            await self.quota.spend(name)
        except QuotaExceeded:
            self.metrics.clients_refused.labels("quota").inc()
            raise


def keyless_routes(routes: Mapping[str, Route]) -> list[str]:
    """Routes whose vendor takes a key in a slot the route does not fill (`headers.set` or
    `keys`): with clients configured, their requests reach the vendor with no key at all."""
    keyless = []
    for name, route in routes.items():
        slot = route.profile.key_slot if route.profile is not None else None
        if slot is None:
            continue
        filled = route.keys is not None or (
            slot.kind == "header"
            and any(header.lower() == slot.name.lower() for header, _ in route.set_headers)
        )
        if not filled:
            keyless.append(name)
    return keyless

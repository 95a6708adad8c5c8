"""What a request asks of the cache: the key deciding which requests share an entry, and the
request's Cache-Control directives. Pure functions, testable without a server."""

from __future__ import annotations

import hashlib
import unicodedata
from dataclasses import dataclass
from functools import lru_cache
from operator import itemgetter
from typing import Any, NamedTuple
from urllib.parse import parse_qsl

import orjson
from multidict import CIMultiDict, MultiMapping

from policies.cache.config import CacheConfig
from policies.cache.entry import MCP_SESSION
from policies.core.credentials import CREDENTIAL_NAMES, is_credential_name
from policies.profiles.reading import NOT_JSON, load_json

_QUERY_FIELDS = frozenset({"query", "q"})
MISSING: Any = object()


@dataclass(frozen=True, slots=True)
class KnownCredentials:
    """Where a route's requests carry credentials besides the names the rule recognises: the
    headers the route sets, and where its vendor reads its key. Lower-case names."""

    headers: frozenset[str] = frozenset()
    params: frozenset[str] = frozenset()  # query parameters and top-level JSON body fields


NO_KNOWN_CREDENTIALS = KnownCredentials()


class Directives(NamedTuple):
    """The request's cache directives (RFC 9111 §5.2.1) that this cache honours."""

    no_cache: bool  # skip the fresh hit; still store, still serve stale on failure
    no_store: bool  # neither read nor write


_NO_DIRECTIVES = Directives(no_cache=False, no_store=False)


def request_directives(headers: MultiMapping[str]) -> Directives:
    """Read Cache-Control (and Pragma when Cache-Control is absent, RFC 9111 §5.4)."""
    values = headers.getall("Cache-Control", ())
    if not values:
        if "no-cache" in headers.get("Pragma", "").lower():
            return Directives(no_cache=True, no_store=False)
        return _NO_DIRECTIVES
    no_cache = no_store = False
    for value in values:
        for item in value.split(","):
            name, _, arg = item.strip().lower().partition("=")
            if name == "no-cache" or (name == "max-age" and arg.strip().strip('"') == "0"):
                no_cache = True
            elif name == "no-store":
                no_store = True
    return Directives(no_cache=no_cache, no_store=no_store)


def session_traffic(headers: CIMultiDict[str], body: bytes) -> bool:
    """Whether a request belongs to one client's session: it names an MCP session, or its body
    is a JSON-RPC message (or batch). Its answer (an `initialize` with the session it opened, a
    reply under this client's ids) is never another caller's, so the cache leaves it alone,
    unless the route reads the messages itself and gives a key of its own (`key_body`)."""
    if MCP_SESSION in headers:
        return True
    if b'"jsonrpc"' not in body:
        return False
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    messages = message if isinstance(message, list) else [message]
    return any(isinstance(m, dict) and "jsonrpc" in m for m in messages)


def _nfc(text: str) -> str:
    # ASCII is NFC already: the check is a flag read, the normalisation a call per string.
    return text if text.isascii() else unicodedata.normalize("NFC", text)


def _text(value: str, field: str | None) -> str:
    value = _nfc(value)
    # str.split() without arguments splits on every run of Unicode whitespace and trims.
    return " ".join(value.split()) if field in _QUERY_FIELDS else value


# Deeper JSON counts byte for byte: no search request nests this far, recursion stays far from
# Python's limit, and orjson refuses to serialise past 255 levels.
MAX_CANONICAL_DEPTH = 64


class _TooDeep(Exception):
    pass


def _canonical(value: Any, field: str | None = None, depth: int = 0) -> Any:
    if isinstance(value, str):
        return _text(value, field)
    if not isinstance(value, dict | list):
        return value
    if depth >= MAX_CANONICAL_DEPTH:
        raise _TooDeep
    # A leaf that stays as it is (a number, or ASCII text outside the query fields) is kept
    # without a call: a search body is mostly such leaves.
    if isinstance(value, dict):
        return {
            (k if k.isascii() else _nfc(k)): (v if _kept(v, k) else _canonical(v, k, depth + 1))
            for k, v in value.items()
        }
    return [v if _kept(v, field) else _canonical(v, field, depth + 1) for v in value]


_KEPT_TYPES = (int, float, bool, type(None))


def _kept(value: Any, field: str | None) -> bool:
    kind = type(value)
    if kind is str:
        return value.isascii() and field not in _QUERY_FIELDS
    return kind in _KEPT_TYPES


def _is_param_credential(name: str, known: frozenset[str]) -> bool:
    # Exact names only: a shared key leaves these out, so a parameter the broad rule would
    # match (`keywords`, `author`) must stay in it or different searches would share an entry.
    return name.lower() in _credential_fields(known)


@lru_cache(maxsize=64)  # one set per route's known names
def _credential_fields(known: frozenset[str]) -> frozenset[str]:
    """The lower-case field and parameter names taken out of a key as credentials."""
    return CREDENTIAL_NAMES | known


# The body parts of recent small bodies, by the bytes themselves: an agent asking again (a
# cache hit) sends the same bytes, and its key then costs a hash instead of a parse, a walk and
# a serialisation. Bounded in entries and in the size of each: at most ~2 MiB held.
MEMO_BODY_BYTES = 4096
MEMO_ENTRIES = 256
_MEMO: dict[tuple[bytes, tuple[str, ...], frozenset[str]], tuple[bytes, tuple[str, ...]]] = {}


def _body_part(
    body: bytes, ignored: tuple[str, ...], known: frozenset[str]
) -> tuple[bytes, list[str]]:
    """The body as it counts for the key, and the credentials taken out of it."""
    if len(body) > MEMO_BODY_BYTES:
        return _read_body_part(body, ignored, known)
    memo = (body, ignored, known)
    found = _MEMO.get(memo)
    if found is None:
        part, credentials = _read_body_part(body, ignored, known)
        if len(_MEMO) >= MEMO_ENTRIES:
            del _MEMO[next(iter(_MEMO))]  # the oldest
        found = _MEMO[memo] = (part, tuple(credentials))
    return found[0], list(found[1])


def _plain_canonical(body: bytes) -> Any:
    """`_canonical(orjson.loads(body))` without the walk, for the usual search body: ASCII with
    no escaped character (every string is NFC already), shallow, and whatever `query`/`q` it
    names a top-level text field (the only strings the walk would change). MISSING when the
    body is not such a body: the walk decides then."""
    if (
        not body.isascii()
        or b"\\u" in body
        or body.count(b"[") + body.count(b"{") > MAX_CANONICAL_DEPTH
    ):
        return MISSING
    data = _parsed(body)
    named = body.count(b'"query"') + body.count(b'"q"')
    if not named:
        return data
    if not isinstance(data, dict):
        return MISSING
    data = dict(data)  # the parse is shared (load_json): change a copy
    for field in _QUERY_FIELDS:
        if field in data:
            value = data[field]
            if not isinstance(value, str):
                return MISSING
            data[field] = " ".join(value.split())
            named -= 1
    # Named anywhere else (deeper, or as a value), the walk decides.
    return data if named == 0 else MISSING


def _parsed(body: bytes) -> Any:
    """`orjson.loads(body)`, from the parse the policies before the cache share when they read
    the same body (the search guard, failover: policies/profiles/reading.py). Never change it."""
    data = load_json(body)
    if data is NOT_JSON:
        raise orjson.JSONDecodeError("not JSON", "", 0)
    return data


def _read_body_part(
    body: bytes, ignored: tuple[str, ...], known: frozenset[str]
) -> tuple[bytes, list[str]]:
    if not body:
        return b"", []
    try:
        data = _plain_canonical(body)
        if data is MISSING:
            data = _canonical(_parsed(body))
    except (orjson.JSONDecodeError, _TooDeep):
        return b"r" + body, []
    credentials: list[str] = []
    if isinstance(data, dict):
        data = dict(data)  # unchanged by the canonical form, it may be the shared parse
        # Credentials first: an ignored field never takes a credential out of the key.
        names = _credential_fields(known)
        for name in sorted(n for n in data if n.lower() in names):
            value = data.pop(name)
            text = value if isinstance(value, str) else orjson.dumps(value).decode()
            credentials.append(f"{name}={text}")
        for name in ignored:
            data.pop(name, None)
    return b"j" + orjson.dumps(data, option=orjson.OPT_SORT_KEYS), credentials


def _query_part(
    query_string: str, known: frozenset[str]
) -> tuple[list[tuple[str, str]], list[str]]:
    """Sorted query parameters, and the credentials taken out of them."""
    if not query_string:
        return [], []
    try:
        pairs = parse_qsl(query_string, keep_blank_values=True, errors="strict")
    except UnicodeDecodeError:
        # Decoding with replacement would map different byte strings to one key.
        return [("", query_string)], []
    params: list[tuple[str, str]] = []
    credentials: list[str] = []
    for name, value in pairs:
        if _is_param_credential(name, known):
            credentials.append(f"{name}={value}")
        else:
            params.append((_nfc(name), _text(value, name)))
    # A stable sort keeps repeated parameters in their order, which may carry meaning.
    params.sort(key=itemgetter(0))
    return params, credentials


def cache_key(
    route: str,
    method: str,
    path: str,
    query_string: str,
    body: bytes,
    headers: CIMultiDict[str],
    cfg: CacheConfig,
    client: str = "",
    known: KnownCredentials = NO_KNOWN_CREDENTIALS,
) -> str:
    """`<route>:<sha256 hex>` over method, path, sorted query, canonical body, the `cfg.vary`
    headers and, unless `cfg.shared`, the caller's credentials: every header whose name is a
    credential (policies/core/credentials.py) or is `known` to the route, the credential
    parameters and body fields (`api_key`, `key`, `token` ..., and `known.params`), `client`.

    JSON bodies count with sorted keys, Unicode NFC and whitespace runs collapsed in `query`/`q`
    fields; credential fields and `cfg.ignore_body_fields` are taken out of the top-level object.
    Any other body, and JSON nested deeper than MAX_CANONICAL_DEPTH, counts byte for byte.
    """
    params, query_credentials = _query_part(query_string, known.params)
    body_part, body_credentials = _body_part(body, cfg.ignore_body_fields, known.params)
    material: list[Any] = [method.upper(), path, params]
    if not cfg.shared:
        material.append(
            _credential_headers(headers, known.headers)
            + query_credentials
            + body_credentials
            + [f"client={client}"]
        )
    if cfg.vary:
        material.append(
            [f"{h.lower()}={_as_sent(v)}" for h in cfg.vary for v in headers.getall(h, ())]
        )
    # orjson escapes control characters, so the NUL cannot occur inside the JSON before it.
    digest = hashlib.sha256(orjson.dumps(material))
    digest.update(b"\x00")
    digest.update(body_part)
    return f"{route}:{digest.hexdigest()}"


def _credential_headers(headers: CIMultiDict[str], known: frozenset[str]) -> list[str]:
    """`name=value` for every credential header, by name (a name's values in their order)."""
    found = []
    for name, value in headers.items():
        lower = name.lower()
        if lower in known or is_credential_name(lower):
            found.append((lower, value))
    found.sort(key=itemgetter(0))
    return [f"{name}={_as_sent(value)}" for name, value in found]


def _as_sent(value: str) -> str:
    """A header value as the key counts it: itself, or, when its bytes were not UTF-8 (read
    with surrogateescape, which orjson refuses), a NUL and the bytes in hex: a form no value
    that was UTF-8 takes (a header never holds a NUL), so two callers' values never meet."""
    if value.isascii():
        return value
    try:
        value.encode()
    except UnicodeEncodeError:
        return "\x00" + value.encode("utf-8", "surrogateescape").hex()
    return value

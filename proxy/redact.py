"""Credentials taken out of text before it is logged, printed or answered: query strings, URLs,
header lines, JSON-ish pairs and free text, by the naming rule of policies/core/credentials.py.
Pure functions."""

from __future__ import annotations

import re
from urllib.parse import unquote_plus, urlsplit

from policies.core.credentials import is_credential_name, is_credential_param

REDACTED = "<redacted>"

# `name=value`, in a query string or in prose; the value ends where a query pair, a quoted
# string or a word would.
_PAIR = re.compile(r"(?<![\w%.-])(?P<name>[\w%.\[\]-]+)=(?P<value>[^\s&#'\"<>]*)")
# `Name: value` (a header line), `"name": "value"` (JSON), `'name': 'value'` or
# `b'name': b'value'` (Python reprs). An unquoted value runs to the end of the line or of the
# quoted literal it sits in.
_COLON_PAIR = re.compile(
    r"(?<![\w.-])(?:b(?=[\"']))?(?P<q>[\"']?)(?P<name>[\w-]+)(?P=q)\s*:[ \t]*"
    r"(?P<value>b?\"(?:[^\"\\\r\n]|\\.)*\"?|b?'(?:[^'\\\r\n]|\\.)*'?|[^\r\n'\"]*)"
)
# An Authorization value wherever it appears without its header name: `Bearer <token>`.
_SCHEME = re.compile(r"(?i)\b(bearer|basic|digest)(\s+)[\w.~+/=-]{4,}")
# The password of a URL's userinfo: `redis://user:password@host`.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^\s/@:]*):([^\s/@]*)@")
# A Python bytes literal: how aiohttp quotes the bytes of a request it could not parse.
_BYTES = re.compile(r"""\bb(['"])(?:\\.|(?!\1).)*\1""")


def _pair(match: re.Match[str]) -> str:
    name = match["name"]
    if match["value"] and is_credential_name(unquote_plus(name)):
        return f"{name}={REDACTED}"
    return match[0]


def _param(match: re.Match[str]) -> str:
    name = match["name"]
    if match["value"] and is_credential_param(unquote_plus(name)):
        return f"{name}={REDACTED}"
    return match[0]


def _colon_pair(match: re.Match[str]) -> str:
    if not is_credential_name(match["name"]) or not match["value"].strip():
        return match[0]
    value = match["value"]
    start = match.start("value") - match.start()
    quote = value.lstrip("b")[:1]
    shown = f"{quote}{REDACTED}{quote}" if quote in ("'", '"') else REDACTED
    return match[0][:start] + shown


def redact_query(query: str) -> str:
    """A query string with the value of every credential-named parameter replaced (`code` and
    `refresh` too)."""
    if "=" not in query:
        return query
    return _PAIR.sub(_param, query)


def redact_text(text: str) -> str:
    """Free text (a log message, an exception, an error) with every credential it shows in a
    recognisable shape replaced: `name=value` and `Name: value` pairs with a credential name,
    `Bearer <token>`, and URL passwords. Text in no such shape cannot be recognised."""
    if "=" not in text and ":" not in text and " " not in text:
        return text
    if "@" in text:
        text = _USERINFO.sub(lambda m: f"{m[1]}{m[2]}:{REDACTED}@", text)
    if "=" in text:
        text = _PAIR.sub(_pair, text)
    if ":" in text:
        text = _COLON_PAIR.sub(_colon_pair, text)
    if " " in text or "\t" in text:
        text = _SCHEME.sub(lambda m: f"{m[1]}{m[2]}{REDACTED}", text)
    return text


def redact_bytes(text: str) -> str:
    """`redact_text`, and every bytes literal (`b'...'`) left out: aiohttp quotes a malformed
    request's bytes, an Authorization line among them, in its errors."""
    if "b'" in text or 'b"' in text:
        text = _BYTES.sub(lambda m: f"b{m[1]}{REDACTED}{m[1]}", text)
    return redact_text(text)


def redact_url(url: str) -> str:
    """A URL with its userinfo's password (or a lone user name, which may be a token) and its
    credential-named query parameters replaced; the rest as written."""
    try:
        parts = urlsplit(url)
        has_password = parts.password is not None
    except ValueError:
        return redact_text(url)
    if "://" not in url:
        return redact_text(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        netloc = f"{user}:{REDACTED}@{host}" if has_password else f"{REDACTED}@{host}"
    # Rebuilt by hand: geturl() would drop the `//` of an empty authority (unix:///path).
    shown = f"{parts.scheme}://{netloc}{parts.path}"
    if parts.query:
        shown += f"?{redact_query(parts.query)}"
    if parts.fragment:
        shown += f"#{parts.fragment}"
    return shown

"""How the fake answers one request (`Fault`, built with its class methods) and what it keeps of
each request it receives (`Received`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

from multidict import CIMultiDictProxy, MultiDict, MultiDictProxy


@dataclass(frozen=True)
class Fault:
    """How to answer one request. Build with the class methods, not the constructor."""

    kind: str
    code: int = 200
    body: Any = None
    headers: Mapping[str, str] | None = None
    seconds: float = 0.0
    error_code: str | None = None

    @classmethod
    def ok(cls) -> Fault:
        """The normal answer (useful as a placeholder inside a script)."""
        return cls("ok")

    @classmethod
    def status(
        cls,
        code: int,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        *,
        error_code: str | None = None,
        retry_after: float | None = None,
    ) -> Fault:
        """Answer ``code``. ``body``: dict/list (JSON), str or bytes; None gives the vendor's
        own error shape (``error_code`` overrides the vendor's code word, e.g. Linkup
        ``INSUFFICIENT_FUNDS_CREDITS``). ``retry_after`` adds a Retry-After header."""
        hdrs = dict(headers or {})
        if retry_after is not None:
            hdrs.setdefault("Retry-After", _fmt_seconds(retry_after))
        return cls("status", code=code, body=body, headers=hdrs or None, error_code=error_code)

    @classmethod
    def hang(cls, seconds: float) -> Fault:
        """Sleep ``seconds`` then answer normally. Cancelled if the client leaves; on server
        shutdown the connection is closed at once."""
        return cls("hang", seconds=seconds)

    @classmethod
    def malformed(cls) -> Fault:
        """200 with the normal JSON cut in half (streams: cut after the first chunk)."""
        return cls("malformed")

    @classmethod
    def empty(cls) -> Fault:
        """The vendor's own empty answer (Brave: no ``web``; SerpAPI: 200 + ``error``;
        Linkup: 400 SEARCH_QUERY_NO_RESULT). Non-search routes answer normally."""
        return cls("empty")

    @classmethod
    def reset(cls) -> Fault:
        """Close the connection (RST) without any answer."""
        return cls("reset")

    @classmethod
    def gzip(cls) -> Fault:
        """The normal answer, gzip-compressed, with ``Content-Encoding: gzip``."""
        return cls("gzip")

    @classmethod
    def missing_results(cls) -> Fault:
        """200 valid JSON without the vendor's result list."""
        return cls("missing_results")


def _fmt_seconds(seconds: float) -> str:
    return str(int(seconds)) if float(seconds).is_integer() else str(seconds)


# --------------------------------------------------------------------------- record


@dataclass(frozen=True)
class Received:
    """One request as the fake received it."""

    method: str
    path: str
    raw_path: str
    query_string: str
    headers: CIMultiDictProxy[str]
    body: bytes
    at: float  # on the fake's clock
    vendor: str | None = None  # vendor name, or "echo", "stream", "sse", "mcp"; None for 404

    @property
    def query(self) -> MultiDictProxy[str]:
        """The query string parsed (repeated keys kept)."""
        return MultiDictProxy(MultiDict(parse_qsl(self.query_string, keep_blank_values=True)))

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body parsed as JSON (raises ValueError if it is not)."""
        return json.loads(self.body)


@dataclass
class Pause:
    """One wait the fake made before answering (a latency or a hang), and how it ended:
    "slept" (the full time), "shutdown" (the server began closing), "cancelled" (the handler was
    cancelled, e.g. the client left), or None while it is still waiting."""

    path: str
    cause: str  # "latency" or "hang"
    seconds: float
    ended: str | None = None

"""What the cache keeps: an `Entry` and its binary form, which replies may be stored, and how
fresh a stored entry is. Pure: no store, no I/O."""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field

import orjson
from multidict import CIMultiDict

from policies.core.flow import Reply
from policies.core.outcome import Outcome
from policies.profiles.reading import NOT_JSON, load_json

# Replayed from the vendor's answer. Everything else (Date, Set-Cookie, framing, hop-by-hop,
# rate-limit counters, request ids) describes the original exchange, not a later replay.
_REPLAYED_HEADERS = frozenset({"content-type", "content-language", "etag", "last-modified"})
_VERSION = 1
# version, stored_at (wall seconds), status, length of the JSON header list; then the body.
_HEAD = struct.Struct(">BdHI")
_ENTRY_OVERHEAD = 96  # the bookkeeping of one LRU slot, so tiny entries are not free
# A vendor answers with the same Content-Type every time: entries share one tuple of such
# headers instead of keeping a copy each (about 170 of an entry's ~1,950 bytes). Only headers
# whose values repeat are shared, and at most _SHARED_MAX sets, so a vendor that varies them
# fills the table once and later sets are kept as they come.
_SHARED_NAMES = frozenset({"content-type", "content-language"})
_SHARED_MAX = 64
_shared: dict[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]] = {}


@dataclass(frozen=True, slots=True)
class Entry:
    """One stored answer: the vendor's status, replayable headers and exact body bytes."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    stored_at: float  # wall seconds
    # What the route read in the answer when it stored it (not in the binary form: an entry from
    # Redis is read again). A hit carries it, so the policies above the cache do not parse it.
    outcome: Outcome | None = field(default=None, compare=False)

    @property
    def size(self) -> int:
        """Bytes counted against the in-process bound."""
        return len(self.body) + sum(len(k) + len(v) for k, v in self.headers) + _ENTRY_OVERHEAD

    def to_bytes(self) -> bytes:
        """A compact binary form: a 15-byte head, the headers as JSON, then the body."""
        head = orjson.dumps(self.headers)
        return _HEAD.pack(_VERSION, self.stored_at, self.status, len(head)) + head + self.body

    @classmethod
    def from_bytes(cls, data: bytes) -> Entry:
        """Read `to_bytes` output; ValueError for anything else."""
        try:
            version, stored_at, status, head_len = _HEAD.unpack_from(data)
        except struct.error as exc:
            raise ValueError(f"cache entry too short: {len(data)} bytes") from exc
        start = _HEAD.size
        if version != _VERSION or start + head_len > len(data):
            raise ValueError(f"not a version {_VERSION} cache entry")
        pairs = orjson.loads(data[start : start + head_len])
        if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(s, str) for s in p)
            for p in pairs
        ):
            raise ValueError("cache entry headers are not a list of name/value pairs")
        headers = _share(tuple((name, value) for name, value in pairs))
        return cls(status, headers, data[start + head_len :], stored_at)

    def reply(self) -> Reply:
        """A new Reply carrying this entry."""
        return Reply(self.status, CIMultiDict(self.headers), self.body, outcome=self.outcome)


def entry_from_reply(reply: Reply, stored_at: float) -> Entry:
    """The entry to store for a (non-streamed) reply."""
    headers = tuple((k, v) for k, v in reply.headers.items() if k.lower() in _REPLAYED_HEADERS)
    return Entry(reply.status, _share(headers), reply.body, stored_at, reply.outcome)


def _share(headers: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """The shared copy of `headers`, when they are all of the kind whose values repeat."""
    found = _shared.get(headers)
    if found is not None:
        return found
    if len(_shared) < _SHARED_MAX and all(k.lower() in _SHARED_NAMES for k, _ in headers):
        _shared[headers] = headers
    return headers


# Headers that make an answer one client's own: a session it opened (MCP's Mcp-Session-Id, a
# cookie). Replayed, the answer would hand the next caller a session that is not its own; like
# nginx's and Varnish's caches, such answers are never stored.
MCP_SESSION = "Mcp-Session-Id"
SESSION_HEADERS = (MCP_SESSION, "Set-Cookie")


def opens_session(reply: Reply) -> bool:
    """Whether the reply opens (or renews) a session for the client it answered."""
    return any(name in reply.headers for name in SESSION_HEADERS)


def default_storable(reply: Reply) -> bool:
    """A 2xx reply whose body parses when its content type says JSON (the parse the policies
    before the cache made of it, when they did)."""
    if not 200 <= reply.status < 300:
        return False
    media = reply.headers.get("Content-Type", "").partition(";")[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):
        return load_json(reply.body) is not NOT_JSON
    return True


class Freshness(enum.Enum):
    """Where an entry stands: served (FRESH), served only if the vendor fails (STALE), or gone."""

    FRESH = "fresh"
    STALE = "stale"
    EXPIRED = "expired"


def freshness(
    stored_at_wall: float, now_wall: float, ttl: float, stale_ttl: float
) -> tuple[Freshness, float]:
    """The entry's state and age in seconds: fresh for `ttl`, then stale for `stale_ttl`."""
    # Replicas' wall clocks differ a little; an entry from the future is simply new.
    age = max(0.0, now_wall - stored_at_wall)
    if age < ttl:
        return Freshness.FRESH, age
    if age < ttl + stale_ttl:
        return Freshness.STALE, age
    return Freshness.EXPIRED, age

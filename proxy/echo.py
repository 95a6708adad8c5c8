"""The secrets the proxy holds (the keys routes inject, clients' tokens, the admin token) kept
out of what agents receive: a vendor that echoes the key it was sent, in a header or its body,
must not hand it to the agent, who should never see a proxy-held key. Each one taken out is
logged (`secret_redacted`)."""

from __future__ import annotations

from collections.abc import Iterable

import orjson
import structlog
from multidict import CIMultiDict

from policies.core.credentials import empty_credential, is_credential_name
from proxy.config import Config
from proxy.redact import REDACTED

log = structlog.get_logger("search_proxy")

MIN_SECRET_CHARS = 8  # shorter configured values (`free`, `json`) are no keys: left alone
_SHOWN = REDACTED.encode()


def held_secrets(config: Config) -> tuple[str, ...]:
    """The keys a config gives the proxy to hold: every credential `headers.set` value (and the
    token after its scheme), the keys of each route's key pool, clients' tokens, the admin
    token, profiles' credential values."""
    found: list[str] = []
    for route in config.routes.values():
        for name, value in route.headers.set.items():
            if is_credential_name(name) and not empty_credential(name, value):
                found += (value, value.partition(" ")[2].strip())
        pool = route.section("keys")
        found += pool.keys if pool is not None else ()
    found += (client.token for client in config.clients.values())
    if config.server.admin_token:
        found.append(config.server.admin_token)
    for profile in config.profiles.values():
        for key, value in (*profile.search_headers.items(), *profile.search_extra.items()):
            if is_credential_name(key) and isinstance(value, str):
                found.append(value)
    return tuple(dict.fromkeys(v for v in found if len(v) >= MIN_SECRET_CHARS))


class EchoGuard:
    """Takes the held secrets out of an answer's headers and body (or a stream's chunks)."""

    def __init__(self, secrets: Iterable[str]) -> None:
        texts = sorted(set(secrets), key=len, reverse=True)  # the longest first: `Bearer k`, `k`
        self.texts = tuple(texts)
        forms: dict[bytes, None] = {}
        for text in texts:
            forms[text.encode()] = None
            forms[orjson.dumps(text)[1:-1]] = None  # as a JSON string writes it
        self.forms = tuple(forms)

    def headers(self, headers: CIMultiDict[str], route: str | None) -> None:
        """Replace every held secret in `headers`' values, in place."""
        if not self.texts:
            return
        # One search over all the values at once (most answers hold no secret); a value is
        # looked at alone only when a secret turned up somewhere.
        every = "\n".join(headers.values())
        if not any(text in every for text in self.texts):
            return
        kept: list[tuple[str, str]] = []
        changed = False
        for name, value in headers.items():
            shown = value
            for text in self.texts:
                if text in shown:
                    shown = shown.replace(text, REDACTED)
            if shown is not value:
                changed = True
                log.warning("secret_redacted", route=route, where="header", header=name)
            kept.append((name, shown))
        if changed:
            headers.clear()
            headers.extend(kept)

    def body(self, data: bytes, route: str | None, where: str = "body") -> bytes:
        """`data` with every held secret (as written, or as a JSON string writes it) replaced."""
        if not self.forms or not data:
            return data
        count = 0
        for form in self.forms:
            if form in data:
                count += data.count(form)
                data = data.replace(form, _SHOWN)
        if count:
            log.warning("secret_redacted", route=route, where=where, count=count)
        return data

    def stream(self, route: str | None) -> StreamScrub:
        """A scrubber for one stream's chunks."""
        return StreamScrub(self, route)

    def unfinished(self, data: bytes) -> int:
        """How many of `data`'s last bytes may be the start of a held secret (in either form)
        that the next bytes finish, a whole shorter secret that a longer one begins with
        included: the longest such end, 0 when there is none."""
        longest = 0
        for form in self.forms:
            # Where an end of `data` could begin `form`: the first match is the longest.
            at = data.find(form[:1], max(0, len(data) - len(form) + 1))
            while at != -1 and len(data) - at > longest:
                if form.startswith(data[at:]):
                    longest = len(data) - at
                    break
                at = data.find(form[:1], at + 1)
        return longest

    def clear_cut(self, data: bytes, cut: int) -> int:
        """`cut`, moved back to the start of every held secret in `data` that it would split."""
        moved = True
        while moved and cut > 0:
            moved = False
            for form in self.forms:
                # A secret split by `cut` lies within len(form) - 1 bytes either side of it.
                at = data.find(form, max(0, cut - len(form) + 1), cut + len(form) - 1)
                if at != -1 and at < cut:
                    cut, moved = at, True
        return cut


class StreamScrub:
    """Takes held secrets out of a stream whose chunks a secret may span: a chunk's end that
    begins one is held back, and read again with the next chunk. Only such an end waits
    (an event's closing blank line never does), so the stream is not slowed."""

    def __init__(self, guard: EchoGuard, route: str | None) -> None:
        self._guard = guard
        self._route = route
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        """What of the stream can go out now that `chunk` came (possibly nothing). What is held
        back is decided on the bytes as they came, and only what goes out is scrubbed: a secret
        that is the start of a longer one waits to see which it is."""
        guard = self._guard
        if not guard.forms:
            return chunk
        data = self._held + chunk
        cut = guard.clear_cut(data, len(data) - guard.unfinished(data))
        self._held = data[cut:]
        return guard.body(data[:cut], self._route, "stream") if cut else b""

    def end(self) -> bytes:
        """The stream ended: what was held back, scrubbed (it began no secret after all, or is
        a whole one)."""
        held, self._held = self._held, b""
        return self._guard.body(held, self._route, "stream")

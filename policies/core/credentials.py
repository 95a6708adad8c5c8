"""Which names carry credentials: one rule for the logs, the printed config and the cache key.

A rule rather than a list, so a vendor's own header (`X-Goog-Api-Key`,
`Ocp-Apim-Subscription-Key`) or parameter (`subscription-key`) is covered without being named.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

# A header, query parameter or field whose name contains one of these (any case) is a credential.
CREDENTIAL_WORDS = (
    "key",
    "token",
    "secret",
    "password",
    "passwd",
    "auth",
    "signature",
    "sig",
    "subscription",
    "credential",
    "session",
    "cookie",
)
# Names that are credentials outright. The first group the words already cover: it is also the
# set of parameter and body-field names certain enough to leave out of a shared cache's key.
CREDENTIAL_NAMES = frozenset(
    {
        "api_key",
        "apikey",
        "api-key",
        "x-api-key",
        "key",
        "token",
        "access_token",
        "access-token",
        "auth",
        "password",
        "secret",
        # Not covered by the words.
        "pass",
        "pwd",
        "jwt",
        "bearer",
        "sid",
    }
)
# Names the words match that are not secrets: an SDK's per-request Idempotency-Key must not
# make every request its own cache entry, nor MCP's Mcp-Session-Id every session (the sessions
# of one key share an idempotent tool's cached result; the Authorization beside it is the key).
NOT_CREDENTIALS = frozenset(
    {"idempotency-key", "x-idempotency-key", "idempotency_key", "mcp-session-id"}
)


# Query parameters that carry a credential though the rule does not name them: an OAuth
# authorization `code` and a `refresh` token (in a body field, `code` is mostly an error code).
QUERY_CREDENTIALS = frozenset({"code", "refresh"})


def is_credential_param(name: str) -> bool:
    """Whether a query parameter of this name carries a credential."""
    return is_credential_name(name) or name.lower() in QUERY_CREDENTIALS


@lru_cache(maxsize=4096)  # a request asks it of every header it carries; names repeat
def is_credential_name(name: str) -> bool:
    """Whether a header, query parameter or field of this name carries a credential."""
    lower = name.lower()
    if lower in CREDENTIAL_NAMES:
        return True
    if lower in NOT_CREDENTIALS:
        return False
    return any(word in lower for word in CREDENTIAL_WORDS)


def empty_credential(name: str, value: str) -> bool:
    """A credential header whose value is empty, or a bare scheme (`Bearer ` from an unset
    `${VAR:-}`): not sent, so the agent's own key passes through on the route."""
    if not is_credential_name(name):
        return False
    scheme, _, rest = value.strip().partition(" ")
    return not scheme or (scheme.lower() in ("bearer", "basic", "token") and not rest.strip())


def injects_key(headers: Mapping[str, str]) -> bool:
    """Whether a route's `headers.set` puts a key of its own on every request (a configured
    key left empty, an unset `${VAR:-}`, is not sent: the caller's own key is used)."""
    return any(is_credential_name(k) and not empty_credential(k, v) for k, v in headers.items())

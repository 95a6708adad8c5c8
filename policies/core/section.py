"""What a policy module exports so the chain builder knows it only by name and order (Envoy's
filter factories): its route `Section` (YAML key, parser and bounds, cross-checks against the
route it sits in, YAML form) and one or more `Link`s, each building the policy for one place in
the chain from the section's config and the route's `Build`.

The order of the links is kept in one place, policies/chain.py.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from policies.core.clock import Clock
from policies.core.events import Events
from policies.core.flow import Classifier, Handler, Policy
from policies.core.kept import Kept
from policies.core.profile import VendorProfile
from policies.core.route import RouteConfig
from policies.core.settings import ConfigError

if TYPE_CHECKING:  # the link loads redis-py: imported where Redis is configured
    from policies.core.redislink import RedisLink

C = TypeVar("C")
T = TypeVar("T")


def plain(obj: Any) -> Any:
    """Dataclasses, enums and frozen collections as plain YAML data; None fields are left out
    (every None is a key's default, and null is not what its parser takes)."""
    if is_dataclass(obj) and not isinstance(obj, type):
        values = ((f.name, getattr(obj, f.name)) for f in fields(obj))
        return {name: plain(value) for name, value in values if value is not None}
    if isinstance(obj, Mapping):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, frozenset):
        return sorted(plain(v) for v in obj)
    if isinstance(obj, tuple | list):
        return [plain(v) for v in obj]
    return obj


def _no_checks(cfg: Any, route: RouteConfig, path: str) -> Iterable[ConfigError]:
    return ()


def _no_references(cfg: Any) -> Iterable[tuple[str, str]]:
    return ()


@dataclass(frozen=True)
class Section(Generic[C]):
    """A policy's section of a route (`routes.<name>.<key>`).

    - `parse(raw, path)`: the config, or ConfigError(s) naming the YAML path; bounds included.
    - `check(cfg, route, path)`: what is wrong with it next to the rest of its route (another
      section it needs, a timeout it must fit in); `path` is the section's own.
    - `refers(cfg)`: the other routes it names as search providers, each with its path under
      the section; the document checks they exist, search, and lead to no cycle.
    - `document(cfg)`: the YAML form that `parse` reads back into an equal config.
    """

    key: str
    parse: Callable[[Any, str], C]
    check: Callable[[C, RouteConfig, str], Iterable[ConfigError]] = _no_checks
    refers: Callable[[C], Iterable[tuple[str, str]]] = _no_references
    document: Callable[[C], Any] = plain


class Budget(Protocol):
    """A retry budget another policy may spend from (the hedge spends the retry loop's)."""

    def try_acquire_retry(self) -> bool: ...


# One request to the route's own upstream, outside any agent's request (the breaker's active
# probe): (method, path with optional ?query, JSON body or b"") -> the vendor's status; a failed
# exchange raises the ProxyError an attempt would.
SideRequest = Callable[[str, str, bytes], Awaitable[int]]


@dataclass(frozen=True)
class Provider:
    """Another search route as seen from this one (or from /v1/search): its chain and what it
    takes to ask it."""

    name: str
    profile: VendorProfile
    handler: Handler
    classify: Classifier
    headers: tuple[tuple[str, str], ...]  # that route's configured headers (its own key)
    total: float  # that route's timeouts.total
    clock: Clock
    # The credential header configured empty (an unset ${VAR:-}): no key of the route's own.
    missing_key: str | None
    # Seconds until its open circuit lets a probe through; None while it is not open.
    circuit_open: Callable[[], float | None]
    # The environment variable the empty key header reads, when it reads one: what to export.
    key_variable: str | None = None


@dataclass
class Build:
    """What a link builds its policy from, besides its section's config: the route, the shared
    parts of the app, and what links earlier in the chain (outer ones) leave for later ones."""

    route: RouteConfig
    clock: Clock
    events: Events
    redis: RedisLink | None
    # The route's vendor (its search section's profile, or an MCP route's search tools), and
    # the classifier every policy of the route reads answers with.
    profile: VendorProfile | None
    classify: Classifier
    # Other routes as providers, looked up when first called (they may be built later).
    providers: Callable[[Sequence[str]], Callable[[], Sequence[Provider]]]
    side_request: SideRequest
    # App-wide parts a policy makes once for all routes (failover's record of spent plans).
    shared: dict[str, Any] = field(default_factory=dict)
    # The stateful parts of the build before a config reload, for `keep`.
    kept: Kept = field(default_factory=Kept)
    # Left by earlier links for later ones.
    halt_retries: Callable[[], bool] | None = None  # by the breaker, for the retry loop
    retry_budget: Budget | None = None  # by the retry loop, for the hedge

    def once(self, name: str, make: Callable[[], T]) -> T:
        """The app-wide part `name`, made by `make` the first time any route asks."""
        if name not in self.shared:
            self.shared[name] = make()
        found: T = self.shared[name]
        return found

    def keep(self, part: str, inputs: object, make: Callable[[], T]) -> T:
        """The route's stateful `part` (a breaker, a store, a window): the one built before a
        config reload when made from equal `inputs` (its section's config and the route settings
        it reads), so its state lives on; else a new one from `make`."""
        return self.kept.take(self.route.name, part, inputs, make)


@dataclass(frozen=True)
class Link(Generic[C]):
    """One place in the chain: the policy `build` makes from the route's `section` config (None:
    nothing at this place, e.g. a failover that belongs on the other side of the cache)."""

    name: str  # the policy as docs/request-flow.md's chain names it
    section: Section[C]
    build: Callable[[C, Build], Policy | None]
    # The config of a route that leaves the section out; None: the policy is left out too.
    default: C | None = None

    def policy(self, build: Build) -> Policy | None:
        cfg = build.route.get(self.section)
        if cfg is None:
            cfg = self.default
        return None if cfg is None else self.build(cfg, build)

"""A route's `breaker:` section: its config, parsed once at start-up, with its YAML bounds."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Final, Literal

from policies.core.errors import seconds_text
from policies.core.profile import HealthCall
from policies.core.section import Section, plain
from policies.core.settings import (
    PATH_CHARS,
    ConfigError,
    choice,
    default_note,
    duration_at_most,
    join,
    number_in,
    parse_duration,
    positive_duration,
    section,
    statuses,
    text,
    whole_in,
)

# The shared record in Redis lives a day, then goes away with a removed route: an opening
# longer than that would be forgotten, so no open time may exceed it.
RECORD_TTL: Final = 86400.0


@dataclass(frozen=True)
class ProbeConfig:
    """`breaker.probe`: a request the operator chooses, sent while the circuit is not closed."""

    every: float  # seconds between probes, across the fleet
    method: str = "GET"
    path: str = "/"  # under the route's upstream, like a request's path; may carry `?query`
    body: str = ""  # sent as application/json when not empty
    expect: frozenset[int] = frozenset()  # statuses that mean the vendor is back; empty: any 2xx

    def healthy(self, status: int) -> bool:
        """Whether a probe answered with `status` says the vendor is back."""
        return status in self.expect if self.expect else 200 <= status < 300


@dataclass(frozen=True)
class BreakerConfig:
    """A route's `breaker:` section."""

    fail_max: int = 5  # consecutive vendor failures that open the circuit
    reset_timeout: float = 30.0  # the longest an opening lasts before a half-open probe
    open_initial: float | None = None  # the first opening; None: every one lasts reset_timeout
    open_multiplier: float = 2.0  # each reopening before a request gets through lasts this x longer
    success_threshold: int = 1  # probe successes that close it again
    half_open_probes: int = 1  # probes admitted at once, fleet-wide
    max_wait: float = 0.0  # how long a request may wait to be admitted; 0: refused at once
    slow_start: float = 0.0  # seconds over which a closed circuit readmits traffic; 0: at once
    # An active probe while open. None: the vendor's free call when its profile has one and
    # the route its own key (`vendor_probe`), else none; False: none.
    probe: ProbeConfig | Literal[False] | None = None

    def open_seconds(self, level: int) -> float:
        """How long the `level`-th consecutive opening lasts (1: the first)."""
        initial = self.reset_timeout if self.open_initial is None else self.open_initial
        return open_seconds(initial, self.open_multiplier, self.reset_timeout, level)

    @property
    def tolerated_failures(self) -> int:
        """Failed probes a half-open trial survives: it can still reach success_threshold
        successes among half_open_probes probes."""
        return max(0, self.half_open_probes - self.success_threshold)


def open_seconds(initial: float, multiplier: float, maximum: float, level: int) -> float:
    """`initial * multiplier ** (level - 1)`, at most `maximum` (Envoy's ejection time, which
    grows with consecutive ejections)."""
    if level <= 1 or multiplier <= 1.0 or initial >= maximum:
        return min(initial, maximum)
    if level - 1 >= math.log(maximum / initial, multiplier):
        return maximum
    return min(maximum, initial * multiplier ** (level - 1))


def parse(raw: Any, path: str) -> BreakerConfig:
    """The `breaker:` section at `path`."""
    cfg = section(
        raw,
        path,
        BreakerConfig,
        {
            "fail_max": whole_in(1),
            "reset_timeout": duration_at_most(RECORD_TTL),
            "open_initial": duration_at_most(RECORD_TTL),
            "open_multiplier": number_in(1.0, 100.0),
            "success_threshold": whole_in(1),
            "half_open_probes": whole_in(1, 100),  # one Redis slot key per probe
            "max_wait": parse_duration,
            "slow_start": parse_duration,
            "probe": _probe,
        },
    )
    if cfg.open_initial is not None and cfg.open_initial > cfg.reset_timeout:
        raise ConfigError(
            join(path, "open_initial"),
            f"must not exceed reset_timeout ({seconds_text(cfg.reset_timeout)}"
            f"{default_note(raw, 'reset_timeout')}), the longest an opening lasts",
        )
    return cfg


def _probe(raw: Any, path: str) -> ProbeConfig | Literal[False]:
    if raw is False:
        return False  # not even the vendor's free call
    return section(
        raw,
        path,
        ProbeConfig,
        {
            "every": positive_duration,
            "method": lambda v, p: choice(
                v.upper() if isinstance(v, str) else v, p, ("GET", "HEAD", "POST")
            ),
            "path": _probe_path,
            "body": _probe_body,
            "expect": lambda v, p: statuses(v if isinstance(v, list) else [v], p),
        },
        required=("every",),
    )


def _probe_path(value: Any, path: str) -> str:
    """A path under the route's upstream, as a request's would be after the prefix, and an
    optional `?query`."""
    found = text(value, path)
    where, _, query = found.partition("?")
    if (
        not where.startswith("/")
        or "//" in where
        or any(seg in (".", "..") for seg in where.split("/"))
        or set(where) - PATH_CHARS - {"%"}
        or any(c in query for c in " #")
        or not query.isprintable()
    ):
        raise ConfigError(path, f"expected a path like /usage or /health?full=1, got {found!r}")
    return found


def _probe_body(value: Any, path: str) -> str:
    """The probe's JSON body: a mapping or list (encoded here), or JSON text."""
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError:
            raise ConfigError(
                path, f"expected JSON (it is sent as application/json), got {value!r}"
            ) from None
        return value
    raise ConfigError(path, f"expected a mapping or JSON text, got {value!r}")


# How often the vendor's free call probes an open circuit when the route says nothing.
VENDOR_PROBE_EVERY: Final = 1.0


def vendor_probe(health: HealthCall | None) -> ProbeConfig | None:
    """The probe a route's breaker runs by default: its vendor's free call, once a second."""
    if health is None:
        return None
    return ProbeConfig(VENDOR_PROBE_EVERY, health.method, health.path, expect=health.expect)


def document(cfg: BreakerConfig) -> Any:
    """The YAML form `parse` reads back into `cfg`."""
    doc = plain(cfg)
    if isinstance(cfg.probe, ProbeConfig) and not cfg.probe.body:
        del doc["probe"]["body"]  # no body: "" is not the JSON text the key takes
    return doc


SECTION: Final = Section("breaker", parse, document=document)

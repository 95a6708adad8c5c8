"""Reading config values: small typed parsers whose every error names the YAML path.

Each policy parses its own section with these (`routes.tavily.timeouts.per_try: expected a
duration like 10s, got "ten"`); the document loader (proxy/config) uses them for the top-level
sections. Unknown keys are errors: a typo must not silently disable a policy. A reason never
quotes a secret's value (`headers.set.*`, or a key named like a credential).
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from decimal import Decimal
from typing import Any, TypeVar

from policies.core.credentials import is_credential_name
from policies.core.errors import seconds_text

T = TypeVar("T")
Parser = Callable[[Any, str], Any]

# The value a reason quotes (`expected a string, got 12345`), left out where it is a secret.
_QUOTED_VALUE = re.compile(r",? got .*$", re.S)


def _holds_secret(path: str) -> bool:
    """A YAML path whose value is a secret: a headers.set value, or a key named like one."""
    last = re.split(r"[.\[\]]+", path.rstrip("]"))[-1]
    return ".headers.set." in f".{path}" or is_credential_name(last)


class ConfigError(Exception):
    """A config problem, located by its YAML path; never quoting a secret's value."""

    def __init__(self, path: str, reason: str) -> None:
        if path and _holds_secret(path):
            reason = _QUOTED_VALUE.sub("", reason)
        super().__init__(f"{path}: {reason}" if path else reason)
        self.path = path
        self.reason = reason


class ConfigErrors(ConfigError):
    """Every problem found in one config, in the order found; str() gives one per line.

    `errors` holds them one by one. With a single error, `path` and `reason` are its own.
    """

    errors: tuple[ConfigError, ...]

    def __init__(self, errors: Iterable[ConfigError]) -> None:
        flat = tuple(
            single
            for error in errors
            for single in (error.errors if isinstance(error, ConfigErrors) else (error,))
        )
        if len(flat) == 1:
            super().__init__(flat[0].path, flat[0].reason)
        else:
            super().__init__("", "\n".join(str(error) for error in flat))
        self.errors = flat


class Collector:
    """Gathers ConfigErrors so that parsing goes on past a bad part and one run reports them all."""

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []

    @contextmanager
    def part(self) -> Iterator[None]:
        """Run the block; a ConfigError in it is recorded and the rest of the block skipped."""
        try:
            yield
        except ConfigError as exc:
            self.errors.extend(exc.errors if isinstance(exc, ConfigErrors) else (exc,))

    def add(self, path: str, reason: str) -> None:
        self.errors.append(ConfigError(path, reason))

    def keys(
        self, raw: Any, path: str, allowed: tuple[str, ...], required: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        """The allowed keys of mapping `raw`; unknown or missing keys are recorded."""
        with self.part():
            mapping(raw, path, allowed, required)
        return {k: v for k, v in raw.items() if k in allowed} if isinstance(raw, dict) else {}

    def parse(
        self, data: Mapping[str, Any], path: str, parsers: Mapping[str, Parser]
    ) -> dict[str, Any]:
        """Each key of `data` parsed by its parser; a key that fails is recorded and left out."""
        out: dict[str, Any] = {}
        for key, value in data.items():
            with self.part():
                out[key] = parsers[key](value, join(path, key))
        return out

    def raise_any(self) -> None:
        if self.errors:
            raise ConfigErrors(self.errors)


# ---------------------------------------------------------------------------------------------
# Scalars

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*$")
DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB)?\s*$")
_SIZE_UNITS = {
    None: 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(s|m|h)\s*$")
HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
FIELD_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # RFC 9110 §5.5: only tab is allowed
# What a `${VAR}` may yield for a number or a boolean: ints, decimals, YAML 1.2 true/false.
_WHOLE = re.compile(r"^\s*[0-9]+\s*$")
_DECIMAL = re.compile(r"^\s*[0-9]+(?:\.[0-9]+)?\s*$")
_BOOLS = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}
# RFC 3986 pchar less pct-encoded: unreserved, sub-delims, ":" and "@".
PATH_CHARS = frozenset(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~!$&'()*+,;=:@/"
)
_DNS_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")
# Durations end up in timers and Redis expiries; longer than a year is a typo, not a policy.
MAX_DURATION = 365 * 86400.0
HTTP_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


def parse_duration(value: Any, path: str) -> float:
    """`250ms`, `10s`, `5m`, `1h` (or a bare number of seconds, also as a `${VAR}` string) to
    seconds, at most a year."""
    if isinstance(value, str) and _DECIMAL.match(value):
        value = float(value)
    if isinstance(value, bool):
        raise ConfigError(path, f"expected a duration like 10s, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value) if 0 <= value <= MAX_DURATION else math.nan
    else:
        m = _DURATION.match(value) if isinstance(value, str) else None
        if not m:
            raise ConfigError(path, f'expected a duration like 10s, got "{value}"')
        seconds = float(m.group(1)) * DURATION_UNITS[m.group(2)]
    if not 0 <= seconds <= MAX_DURATION:  # also NaN
        raise ConfigError(path, f"expected a duration from 0 to 365 days, got {value!r}")
    return seconds


def positive_duration(value: Any, path: str, maximum: float = MAX_DURATION) -> float:
    """A duration where 0 makes no sense (a timeout every attempt would hit at once)."""
    seconds = parse_duration(value, path)
    if not 0 < seconds <= maximum:
        raise ConfigError(
            path, f"expected a duration above 0 and at most {seconds_text(maximum)}, got {value!r}"
        )
    return seconds


def duration_at_most(maximum: float) -> Parser:
    """A positive duration of at most `maximum` seconds."""
    return lambda value, path: positive_duration(value, path, maximum)


def parse_size(value: Any, path: str) -> int:
    """`1MiB`, `512KiB`, `2MB` (or a bare number of bytes) to bytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _SIZE.match(value) if isinstance(value, str) else None
    if not m:
        raise ConfigError(path, f'expected a size like 1MiB, got "{value}"')
    # Decimal: a long digit string overflows a float to inf, and int(inf) raises.
    return int(Decimal(m.group(1)) * _SIZE_UNITS[m.group(2)])


def parse_rate(value: Any, path: str) -> float:
    """`10/s`, `600/m`, `3600/h` to tokens per second."""
    m = _RATE.match(value) if isinstance(value, str) else None
    count = float(m.group(1)) if m else 0.0
    if not m or not 0 < count < math.inf:
        raise ConfigError(path, f'expected a rate like 10/s or 600/m, got "{value}"')
    return count / DURATION_UNITS[m.group(2)]


def _bounds(minimum: float, maximum: float | None) -> str:
    return f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"


def whole(value: Any, path: str, minimum: int = 0, maximum: int | None = None) -> int:
    """A whole number in range; a string of digits (from `${VAR}`) counts as one."""
    if isinstance(value, str) and _WHOLE.match(value):
        value = int(value)
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        raise ConfigError(
            path, f"expected a whole number {_bounds(minimum, maximum)}, got {value!r}"
        )
    return value


def whole_in(minimum: int = 0, maximum: int | None = None) -> Parser:
    """A parser of whole numbers from `minimum` to `maximum`."""
    return lambda value, path: whole(value, path, minimum, maximum)


# No search vendor serves one key anywhere near this many calls a second (Tavily's production
# keys: 1,000 a minute): a floor of retries or hedges above it is a typo, not a plan.
MAX_CALLS_PER_S = 1000


def calls_per_s(value: Any, path: str) -> int:
    """A whole number of vendor calls a second, 0 to MAX_CALLS_PER_S."""
    found = whole(value, path)
    if found > MAX_CALLS_PER_S:
        raise ConfigError(
            path,
            f"{found} calls a second is more than any search vendor serves (at most "
            f"{MAX_CALLS_PER_S}); a floor that high would let every failure be retried",
        )
    return found


def number(value: Any, path: str, minimum: float = 0.0, maximum: float | None = None) -> float:
    """A finite number in range; a decimal string (from `${VAR}`) counts as one."""
    if isinstance(value, str) and _DECIMAL.match(value):
        value = float(value)
    found = float(value) if isinstance(value, float) else math.nan
    if isinstance(value, int) and not isinstance(value, bool):
        found = float(value) if abs(value) < 2**63 else math.inf  # float(10**400) raises
    top = math.inf if maximum is None else maximum
    if not minimum <= found <= top or found == math.inf:
        raise ConfigError(path, f"expected a number {_bounds(minimum, maximum)}, got {value!r}")
    return found


def number_in(minimum: float = 0.0, maximum: float | None = None) -> Parser:
    """A parser of numbers from `minimum` to `maximum`."""
    return lambda value, path: number(value, path, minimum, maximum)


def boolean(value: Any, path: str) -> bool:
    """true or false; the strings YAML 1.2 reads as booleans (from `${VAR}`) count too."""
    if isinstance(value, str) and value.strip() in _BOOLS:
        return _BOOLS[value.strip()]
    if not isinstance(value, bool):
        raise ConfigError(path, f"expected true or false, got {value!r}")
    return value


def port(value: Any, path: str) -> int:
    """A port to listen on; 0 picks a free one."""
    return whole(value, path, 0, 65535)


def is_host(host: str) -> bool:
    """A DNS name (ASCII; write an IDN in its xn-- form) or an IP address."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
        return len(host) <= 253 and all(_DNS_LABEL.match(label) for label in labels)


def host(value: Any, path: str) -> str:
    found = text(value, path)
    if not is_host(found):
        raise ConfigError(path, f"expected a host name or an IP address, got {found!r}")
    return found


def text(value: Any, path: str) -> str:
    """A non-empty string."""
    if not isinstance(value, str) or not value:
        raise ConfigError(path, f"expected a non-empty string, got {value!r}")
    return value


def one_line(value: Any, path: str) -> str:
    """A non-empty string without control characters (it travels in a header)."""
    found = text(value, path)
    if FIELD_CONTROL.search(found):
        raise ConfigError(path, "expected a one-line string value")
    return found


def choice(value: Any, path: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(path, f"expected one of {', '.join(choices)}, got {value!r}")
    return value


def one_of(*choices: str) -> Parser:
    """A parser taking one of `choices`."""
    return lambda value, path: choice(value, path, choices)


def texts(value: Any, path: str) -> tuple[str, ...]:
    """A list of non-empty strings."""
    if not isinstance(value, list):
        raise ConfigError(path, f"expected a list of strings, got {value!r}")
    return tuple(text(v, f"{path}[{i}]") for i, v in enumerate(value))


def methods(value: Any, path: str) -> frozenset[str]:
    """A list of HTTP methods, upper-cased."""
    found = texts(value, path)
    for i, m in enumerate(found):
        if m.upper() not in HTTP_METHODS:
            raise ConfigError(f"{path}[{i}]", f"expected an HTTP method, got {m!r}")
    return frozenset(m.upper() for m in found)


def header_names(value: Any, path: str) -> tuple[str, ...]:
    names = texts(value, path)
    for i, name in enumerate(names):
        if not HEADER_NAME.match(name):
            raise ConfigError(f"{path}[{i}]", f"expected a header name, got {name!r}")
    return names


def status(value: Any, path: str) -> int:
    """An HTTP status code. YAML reads the key of `{404: [...]}` as an int but of
    `{"404": [...]}` as a string: both count."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 100 <= value <= 599:
        raise ConfigError(path, f"expected an HTTP status code (100-599), got {value!r}")
    return value


def statuses(value: Any, path: str) -> frozenset[int]:
    if not isinstance(value, list):
        raise ConfigError(path, f"expected a list of status codes, got {value!r}")
    return frozenset(status(s, f"{path}[{i}]") for i, s in enumerate(value))


def optional(parse: Callable[[Any, str], T]) -> Callable[[Any, str], T | None]:
    """`parse`, but null is accepted too: it clears a value a default (or an extended profile)
    set."""
    return lambda value, path: None if value is None else parse(value, path)


# ---------------------------------------------------------------------------------------------
# Mappings


def join(path: str, key: str) -> str:
    """The YAML path of `key` under `path`."""
    return f"{path}.{key}" if path else key


def mapping(
    value: Any, path: str, allowed: tuple[str, ...], required: tuple[str, ...] = ()
) -> dict[str, Any]:
    """`value` as a mapping of only `allowed` keys with every `required` one; null is {}."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(path, f"expected a mapping, got {type(value).__name__}")
    problems = [
        ConfigError(join(path, str(key)), f"unknown key (allowed: {', '.join(allowed)})")
        for key in value
        if key not in allowed
    ]
    problems += [
        ConfigError(join(path, key), "required key is missing")
        for key in required
        if key not in value
    ]
    if problems:
        raise ConfigErrors(problems)
    return value


def any_keys(value: Any, path: str) -> dict[Any, Any]:
    """A mapping whose keys are the user's own names (routes, clients, profiles)."""
    return mapping(value, path, tuple(value) if isinstance(value, dict) else ())


def fields(
    raw: Any, path: str, parsers: Mapping[str, Parser], required: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Mapping `raw` with each present key parsed by its parser; every bad key is reported."""
    collect = Collector()
    kwargs = collect.parse(collect.keys(raw, path, tuple(parsers), required), path, parsers)
    collect.raise_any()
    return kwargs


def section(
    raw: Any,
    path: str,
    cls: Callable[..., T],
    parsers: Mapping[str, Parser],
    required: tuple[str, ...] = (),
) -> T:
    """Build dataclass `cls` from mapping `raw`, parsing each present key with its parser."""
    return cls(**fields(raw, path, parsers, required))


def given(raw: Any) -> Mapping[str, Any]:
    """The keys a section's YAML actually wrote (to tell a user's value from a default)."""
    return raw if isinstance(raw, dict) else {}


def default_note(raw: Any, key: str) -> str:
    """`, the default` when `key` was not written, for a reason that quotes its value."""
    return "" if key in given(raw) else ", the default"


def rate_text(per_s: float) -> str:
    """A rate parse_rate reads back as exactly `per_s`: whole per s, m or h if one is exact."""
    for unit in ("s", "m", "h"):
        count = round(per_s * DURATION_UNITS[unit])
        if count and count / DURATION_UNITS[unit] == per_s:
            return f"{count}/{unit}"
    # The shortest repr reads back exactly; "f" keeps it out of exponent form, which the
    # rate pattern does not take.
    return f"{format(Decimal(repr(per_s)), 'f')}/s"

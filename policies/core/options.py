"""Unified search options (result count, time range, domains, topic, country, language, safe
search), and the vocabulary of a vendor's option table: where each option goes in its request
and the converters between unified and vendor values that several vendors share.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any, Final, Literal, get_args

TimeRange = Literal["day", "week", "month", "year"]
Topic = Literal["general", "news"]
TIME_RANGES: tuple[str, ...] = get_args(TimeRange)
TOPICS: tuple[str, ...] = get_args(Topic)
OPTION_NAMES: tuple[str, ...] = (
    "max_results",
    "time_range",
    "include_domains",
    "exclude_domains",
    "topic",
    "country",
    "language",
    "safe_search",
)
MAX_DOMAINS = 300  # Tavily's limit for include_domains, the highest of the vendors'

# ISO 3166-1 alpha-2, officially assigned codes.
ISO_COUNTRIES: frozenset[str] = frozenset(
    """AD AE AF AG AI AL AM AO AQ AR AS AT AU AW AX AZ BA BB BD BE BF BG BH BI BJ BL BM BN BO BQ
    BR BS BT BV BW BY BZ CA CC CD CF CG CH CI CK CL CM CN CO CR CU CV CW CX CY CZ DE DJ DK DM DO
    DZ EC EE EG EH ER ES ET FI FJ FK FM FO FR GA GB GD GE GF GG GH GI GL GM GN GP GQ GR GS GT GU
    GW GY HK HM HN HR HT HU ID IE IL IM IN IO IQ IR IS IT JE JM JO JP KE KG KH KI KM KN KP KR KW
    KY KZ LA LB LC LI LK LR LS LT LU LV LY MA MC MD ME MF MG MH MK ML MM MN MO MP MQ MR MS MT MU
    MV MW MX MY MZ NA NC NE NF NG NI NL NO NP NR NU NZ OM PA PE PF PG PH PK PL PM PN PR PS PT PW
    PY QA RE RO RS RU RW SA SB SC SD SE SG SH SI SJ SK SL SM SN SO SR SS ST SV SX SY SZ TC TD TF
    TG TH TJ TK TL TM TN TO TR TT TV TW TZ UA UG UM US UY UZ VA VC VE VG VI VN VU WF WS YE YT ZA
    ZM ZW""".split()
)
# Common mistakes for ISO codes, named in the error message.
_COUNTRY_HINTS = {"UK": "GB", "EN": "GB", "EL": "GR"}
_LANGUAGE = re.compile(r"^[a-z]{2}$")
_DOMAIN = re.compile(r"^(\*\.)?[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*\.?$")


class OptionError(ValueError):
    """An invalid option value; `option` names it, `reason` completes the sentence."""

    def __init__(self, option: str, reason: str) -> None:
        super().__init__(f"{option} {reason}")
        self.option = option
        self.reason = reason


@dataclass(frozen=True, slots=True)
class SearchOptions:
    """What an agent asks of a search besides the query, in one vendor-neutral shape.

    Validated and normalised on construction (country upper-case, language and domains
    lower-case, domain lists as tuples); an invalid value raises OptionError. Unset options are
    None (or empty), and leave the vendor's own default in place.
    """

    max_results: int | None = None
    time_range: str | None = None  # published or updated within the last day/week/...
    include_domains: tuple[str, ...] = ()  # only results from these domains (and subdomains)
    exclude_domains: tuple[str, ...] = ()
    topic: str | None = None  # general web search, or news
    country: str | None = None  # ISO 3166-1 alpha-2: where results should come from
    language: str | None = None  # ISO 639-1: the language results should be in
    safe_search: bool | None = None  # True: filter adult content; False: do not

    def __post_init__(self) -> None:
        put = object.__setattr__
        if self.max_results is not None and (
            isinstance(self.max_results, bool)
            or not isinstance(self.max_results, int)
            or self.max_results < 1
        ):
            raise OptionError("max_results", "must be a whole number of at least 1")
        if self.time_range is not None and self.time_range not in TIME_RANGES:
            raise OptionError("time_range", f"must be one of {', '.join(TIME_RANGES)}")
        for name in ("include_domains", "exclude_domains"):
            put(self, name, _domains(name, getattr(self, name)))
        if self.topic is not None and self.topic not in TOPICS:
            raise OptionError("topic", f"must be one of {', '.join(TOPICS)}")
        if self.country is not None:
            put(self, "country", _country(self.country))
        if self.language is not None:
            if not isinstance(self.language, str) or not _LANGUAGE.match(self.language.lower()):
                raise OptionError("language", "must be an ISO 639-1 code of two letters, like en")
            put(self, "language", self.language.lower())
        if self.safe_search is not None and not isinstance(self.safe_search, bool):
            raise OptionError("safe_search", "must be true or false")

    def requested(self) -> tuple[str, ...]:
        """The options set besides max_results, in OPTION_NAMES order."""
        return tuple(
            name
            for name in OPTION_NAMES[1:]
            if getattr(self, name) is not None and getattr(self, name) != ()
        )


def _domains(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise OptionError(name, 'must be a list of domain names, like ["example.com"]')
    if len(value) > MAX_DOMAINS:
        raise OptionError(name, f"has {len(value)} domains, over the limit of {MAX_DOMAINS}")
    out: list[str] = []
    for item in value:
        domain = item.strip().lower() if isinstance(item, str) else ""
        if not _DOMAIN.match(domain) or len(domain) > 253:
            raise OptionError(name, f"has {item!r}, which is not a domain name like example.com")
        if domain not in out:
            out.append(domain)
    return tuple(out)


def _country(value: Any) -> str:
    code = value.strip().upper() if isinstance(value, str) else ""
    if code in ISO_COUNTRIES:
        return code
    hint = f" ({code} is not one: use {_COUNTRY_HINTS[code]})" if code in _COUNTRY_HINTS else ""
    raise OptionError("country", f"must be an ISO 3166-1 alpha-2 code, like US or DE{hint}")


# ---------------------------------------------------------------------------------------------
# A vendor's table, and the converters several vendors' tables share

# A converter's answer that means "honoured by sending nothing" (the vendor's default already is
# what was asked, e.g. Exa without a `category` is a general search).
OMIT: Final[Any] = object()
Convert = Callable[[Any, datetime], Any]  # (value, now) -> converted; None: cannot be expressed


def same(value: Any, now: datetime) -> Any:
    """The unified value is the vendor's."""
    return value


@dataclass(frozen=True, slots=True)
class OptionField:
    """Where one unified option goes in a vendor's request, and how its value is converted.

    `write` turns the unified value into the vendor's (None: this value cannot be expressed, so
    the option is dropped; OMIT: honoured without sending anything). `read` is the inverse, for a
    request in the vendor's shape (None: no unified value means the same). `when`, if set, must
    hold for the option to be honoured (Tavily's country only applies to general searches).
    """

    field: str  # a top-level JSON body key (POST) or query parameter (GET)
    write: Convert = same
    read: Convert = same
    when: Callable[[SearchOptions], bool] | None = None


@dataclass(frozen=True, slots=True)
class VendorOptions:
    """One vendor's table: unified option name -> its request field. An option not listed is
    dropped, except topic "general", which is every vendor's default search."""

    fields: Mapping[str, OptionField]
    news_paths: tuple[str, ...] = ()  # request paths (suffixes) that are news searches

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", MappingProxyType(dict(self.fields)))


NO_OPTIONS = VendorOptions({})  # a profile written from scratch: every option is dropped


_RANGE_DAYS: Mapping[str, int] = MappingProxyType({"day": 1, "week": 7, "month": 30, "year": 365})
# The longest span each range still covers when read back from a start date (a month may be
# 31 days; a date without a time adds up to one more day).
_RANGE_READ_LIMIT = (("day", 2), ("week", 8), ("month", 32), ("year", 367))


def _since(time_range: str, now: datetime) -> datetime:
    return now - timedelta(days=_RANGE_DAYS[time_range])


def range_since(start: datetime, now: datetime) -> str | None:
    """The narrowest time range covering everything since `start` (None: over a year ago)."""
    days = (now - start).total_seconds() / 86400
    return next((name for name, limit in _RANGE_READ_LIMIT if days < limit), None)


def _parse_when(value: Any) -> datetime | None:
    """An ISO 8601 date or date-time (a naive one is UTC); None if it is neither."""
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def iso_start(value: Any, now: datetime) -> Any:
    """A time range as the UTC date-time it starts at (`2024-05-03T15:00:00.000Z`)."""
    return _since(value, now).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def date_start(value: Any, now: datetime) -> Any:
    """A time range as the date it starts on (`2024-05-03`)."""
    return _since(value, now).date().isoformat()


def read_start(value: Any, now: datetime) -> Any:
    """The time range a start date or date-time asks for (`iso_start`, `date_start` read back)."""
    start = _parse_when(value)
    return range_since(start, now) if start is not None else None


def table(mapping: Mapping[Any, str], default: Any = None) -> tuple[Convert, Convert]:
    """A (write, read) pair for values that map one to one; a key may list several vendor values
    separated by '|', the first written, all read."""
    forward = {k: v.split("|")[0] for k, v in mapping.items()}
    back = {alias: k for k, v in mapping.items() for alias in v.split("|")}

    def write(value: Any, now: datetime) -> Any:
        return forward.get(value, default)

    def read(value: Any, now: datetime) -> Any:
        return back.get(value) if isinstance(value, str) else None

    return write, read


def domain_field(field: str, when: Callable[[SearchOptions], bool] | None = None) -> OptionField:
    """A list of domains, sent as a list and read from a list or comma-separated text."""
    return OptionField(field, as_list, read_list, when)


def as_list(value: Any, now: datetime) -> Any:
    """A domain tuple as the JSON list (or, in a GET, comma-separated parameter) vendors take."""
    return list(value)


def read_list(value: Any, now: datetime) -> Any:
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None


def read_bool(value: Any, now: datetime) -> Any:
    """A JSON boolean, or `true`/`false` in a query string."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return None


def lower(value: Any, now: datetime) -> Any:
    return value.lower()


def read_code(value: Any, now: datetime) -> Any:
    """A country or language code as sent (`us`, `en`, `en-GB`): its first two letters."""
    if not isinstance(value, str):
        return None
    head = value.split("-")[0].split("_")[0]
    return head if len(head) == 2 and head.isalpha() else None


def qdr(value: Any, now: datetime) -> Any:
    """A time range as Google's `tbs` value (`qdr:w`)."""
    return {"day": "qdr:d", "week": "qdr:w", "month": "qdr:m", "year": "qdr:y"}[value]


def read_qdr(value: Any, now: datetime) -> Any:
    """Google's `tbs` (`qdr:w`, maybe among other comma-separated parts); hours read as day."""
    if not isinstance(value, str):
        return None
    for part in value.split(","):
        unit = part.strip().removeprefix("qdr:")
        if part.strip().startswith("qdr:") and unit[:1] in ("h", "d", "w", "m", "y"):
            return {"h": "day", "d": "day", "w": "week", "m": "month", "y": "year"}[unit[:1]]
    return None

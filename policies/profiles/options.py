"""Unified search options (result count, time range, domains, topic, country, language, safe
search) and, per vendor, the request field each one becomes: one table per vendor, read both ways.

`apply_options` writes options into a vendor's search request and names the ones that vendor
cannot honour; `read_options` reads them back out of a request in the vendor's own shape. Both
are pure: relative time ranges are computed from an injected `now`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any, Final, Literal, get_args
from urllib.parse import parse_qsl

from policies.core.profile import SearchRequest, VendorProfile

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
# Per-vendor tables

# A converter's answer that means "honoured by sending nothing" (the vendor's default already is
# what was asked, e.g. Exa without a `category` is a general search).
OMIT: Final[Any] = object()
Convert = Callable[[Any, datetime], Any]  # (value, now) -> converted; None: cannot be expressed


def _same(value: Any, now: datetime) -> Any:
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
    write: Convert = _same
    read: Convert = _same
    when: Callable[[SearchOptions], bool] | None = None


@dataclass(frozen=True, slots=True)
class VendorOptions:
    """One vendor's table: unified option name -> its request field. An option not listed is
    dropped, except topic "general", which is every vendor's default search."""

    fields: Mapping[str, OptionField]
    news_paths: tuple[str, ...] = ()  # request paths (suffixes) that are news searches

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", MappingProxyType(dict(self.fields)))


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


def _iso_start(value: Any, now: datetime) -> Any:
    return _since(value, now).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def _date_start(value: Any, now: datetime) -> Any:
    return _since(value, now).date().isoformat()


def _read_start(value: Any, now: datetime) -> Any:
    start = _parse_when(value)
    return range_since(start, now) if start is not None else None


def _table(mapping: Mapping[Any, str], default: Any = None) -> tuple[Convert, Convert]:
    """A (write, read) pair for values that map one to one; a key may list several vendor values
    separated by '|', the first written, all read."""
    forward = {k: v.split("|")[0] for k, v in mapping.items()}
    back = {alias: k for k, v in mapping.items() for alias in v.split("|")}

    def write(value: Any, now: datetime) -> Any:
        return forward.get(value, default)

    def read(value: Any, now: datetime) -> Any:
        return back.get(value) if isinstance(value, str) else None

    return write, read


def _domain_field(field: str, when: Callable[[SearchOptions], bool] | None = None) -> OptionField:
    return OptionField(field, _code_list, _read_list, when)


def _code_list(value: Any, now: datetime) -> Any:
    return list(value)


def _read_list(value: Any, now: datetime) -> Any:
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None


def _read_bool(value: Any, now: datetime) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return None


def _lower(value: Any, now: datetime) -> Any:
    return value.lower()


def _read_code(value: Any, now: datetime) -> Any:
    """A country or language code as sent (`us`, `en`, `en-GB`): its first two letters."""
    if not isinstance(value, str):
        return None
    head = value.split("-")[0].split("_")[0]
    return head if len(head) == 2 and head.isalpha() else None


def _qdr(value: Any, now: datetime) -> Any:
    return {"day": "qdr:d", "week": "qdr:w", "month": "qdr:m", "year": "qdr:y"}[value]


def _read_qdr(value: Any, now: datetime) -> Any:
    """Google's `tbs` (`qdr:w`, maybe among other comma-separated parts); hours read as day."""
    if not isinstance(value, str):
        return None
    for part in value.split(","):
        unit = part.strip().removeprefix("qdr:")
        if part.strip().startswith("qdr:") and unit[:1] in ("h", "d", "w", "m", "y"):
            return {"h": "day", "d": "day", "w": "week", "m": "month", "y": "year"}[unit[:1]]
    return None


# --- Tavily: `country` is a lower-case English name from a fixed list (Tavily's OpenAPI enum),
# and only applies to general searches.
TAVILY_COUNTRIES: Mapping[str, str] = MappingProxyType(
    {
        code: name
        for code, name in (
            entry.strip().split(" ", 1)
            for entry in """
    AF afghanistan | AL albania | DZ algeria | AD andorra | AO angola | AR argentina |
    AM armenia | AU australia | AT austria | AZ azerbaijan | BS bahamas | BH bahrain |
    BD bangladesh | BB barbados | BY belarus | BE belgium | BZ belize | BJ benin | BT bhutan |
    BO bolivia | BA bosnia and herzegovina | BW botswana | BR brazil | BN brunei | BG bulgaria |
    BF burkina faso | BI burundi | KH cambodia | CM cameroon | CA canada | CV cape verde |
    CF central african republic | TD chad | CL chile | CN china | CO colombia | KM comoros |
    CG congo | CR costa rica | HR croatia | CU cuba | CY cyprus | CZ czech republic |
    DK denmark | DJ djibouti | DO dominican republic | EC ecuador | EG egypt | SV el salvador |
    GQ equatorial guinea | ER eritrea | EE estonia | ET ethiopia | FJ fiji | FI finland |
    FR france | GA gabon | GM gambia | GE georgia | DE germany | GH ghana | GR greece |
    GT guatemala | GN guinea | HT haiti | HN honduras | HU hungary | IS iceland | IN india |
    ID indonesia | IR iran | IQ iraq | IE ireland | IL israel | IT italy | JM jamaica |
    JP japan | JO jordan | KZ kazakhstan | KE kenya | KW kuwait | KG kyrgyzstan | LV latvia |
    LB lebanon | LS lesotho | LR liberia | LY libya | LI liechtenstein | LT lithuania |
    LU luxembourg | MG madagascar | MW malawi | MY malaysia | MV maldives | ML mali | MT malta |
    MR mauritania | MU mauritius | MX mexico | MD moldova | MC monaco | MN mongolia |
    ME montenegro | MA morocco | MZ mozambique | MM myanmar | NA namibia | NP nepal |
    NL netherlands | NZ new zealand | NI nicaragua | NE niger | NG nigeria | KP north korea |
    MK north macedonia | NO norway | OM oman | PK pakistan | PA panama | PG papua new guinea |
    PY paraguay | PE peru | PH philippines | PL poland | PT portugal | QA qatar | RO romania |
    RU russia | RW rwanda | SA saudi arabia | SN senegal | RS serbia | SG singapore |
    SK slovakia | SI slovenia | SO somalia | ZA south africa | KR south korea | SS south sudan |
    ES spain | LK sri lanka | SD sudan | SE sweden | CH switzerland | SY syria | TW taiwan |
    TJ tajikistan | TZ tanzania | TH thailand | TG togo | TT trinidad and tobago | TN tunisia |
    TR turkey | TM turkmenistan | UG uganda | UA ukraine | AE united arab emirates |
    GB united kingdom | US united states | UY uruguay | UZ uzbekistan | VE venezuela |
    VN vietnam | YE yemen | ZM zambia | ZW zimbabwe
""".split("|")
        )
    }
)
_TAVILY_COUNTRY = _table(TAVILY_COUNTRIES)
_TAVILY_RANGE = _table({"day": "day|d", "week": "week|w", "month": "month|m", "year": "year|y"})
_TOPIC_SAME = _table({"general": "general", "news": "news"})
_NEWS_OR_OMIT = _table({"news": "news"}, default=OMIT)

# --- Brave: fixed lists of regions and search languages (Brave's documentation); anything else
# is refused with a 422 that reads like a bad key, so it is dropped instead.
BRAVE_COUNTRIES = frozenset(
    "AR AU AT BE BR CA CL DK FI FR DE HK IN ID IT JP KR MY MX NL NZ NO CN PL PT PH RU SA ZA ES SE "
    "CH TW TR GB US".split()
)
_BRAVE_LANGS = {
    **{c: c for c in "ar eu bn bg ca hr cs da nl en et fi fr gl de gu he hi hu is it kn ko lv "
       "lt ms ml mr nb pl pa ro ru sr sk sl es sv ta te th tr uk vi".split()},
    "ja": "jp", "zh": "zh-hans|zh-hant", "pt": "pt-br|pt-pt", "no": "nb",
}  # fmt: skip
_BRAVE_LANG = _table(_BRAVE_LANGS)
_BRAVE_FRESHNESS = _table({"day": "pd", "week": "pw", "month": "pm", "year": "py"})
_BRAVE_SAFE = _table({True: "strict", False: "off"})


def _brave_country(value: Any, now: datetime) -> Any:
    return value if value in BRAVE_COUNTRIES else None


def _read_brave_freshness(value: Any, now: datetime) -> Any:
    """pd/pw/pm/py, or a custom `YYYY-MM-DDtoYYYY-MM-DD` range read from its start."""
    if isinstance(value, str) and "to" in value:
        return _read_start(value.split("to")[0], now)
    return _BRAVE_FRESHNESS[1](value, now)


def _read_brave_safe(value: Any, now: datetime) -> Any:
    return {"strict": True, "off": False}.get(value) if isinstance(value, str) else None


# --- SerpAPI, Scavio, SearXNG: Google-style and SearXNG values.
_SERPAPI_SAFE = _table({True: "active", False: "off"})
_SERPAPI_TBM = _table({"news": "nws"}, default=OMIT)
_SCAVIO_PERIOD = _table(
    {"day": "last_day|last_hour", "week": "last_week", "month": "last_month", "year": "last_year"}
)
_SEARXNG_SAFE = _table({True: "2", False: "0"})


def _scavio_safe(value: Any, now: datetime) -> Any:
    return "active" if value else OMIT  # SafeSearch is off unless `safe: active`


def _read_scavio_safe(value: Any, now: datetime) -> Any:
    return True if value == "active" else None


def _read_searxng_language(value: Any, now: datetime) -> Any:
    return None if value in ("all", "auto") else _read_code(value, now)


def _read_searxng_categories(value: Any, now: datetime) -> Any:
    parts = {p.strip() for p in value.split(",")} if isinstance(value, str) else set()
    return next(iter(parts)) if len(parts) == 1 and parts <= {"general", "news"} else None


# --- Firecrawl: `sources` is a list of names or of {"type": name} objects.
def _firecrawl_sources(value: Any, now: datetime) -> Any:
    return ["news"] if value == "news" else OMIT


def _read_firecrawl_sources(value: Any, now: datetime) -> Any:
    if not isinstance(value, list):
        return None
    names: set[Any] = {v.get("type") if isinstance(v, dict) else v for v in value}
    return {frozenset({"news"}): "news", frozenset({"web"}): "general"}.get(frozenset(names))


# --- Exa: `userLocation` is a country code or {"country": code, ...}.
def _read_exa_location(value: Any, now: datetime) -> Any:
    if isinstance(value, dict):
        value = value.get("country")
    return value if isinstance(value, str) else None


def _exa_excludes(options: SearchOptions) -> bool:
    return not options.include_domains  # Exa takes one of includeDomains and excludeDomains


def _tavily_country_applies(options: SearchOptions) -> bool:
    return options.topic != "news"


VENDOR_OPTIONS: Mapping[str, VendorOptions] = MappingProxyType(
    {
        # tavily-python 0.8.5 and Tavily's OpenAPI document. Its SDK also sends `language`, in a
        # format not documented there: dropped rather than guessed.
        "tavily": VendorOptions(
            {
                "time_range": OptionField("time_range", *_TAVILY_RANGE),
                "include_domains": _domain_field("include_domains"),
                "exclude_domains": _domain_field("exclude_domains"),
                "topic": OptionField("topic", *_TOPIC_SAME),
                "country": OptionField("country", *_TAVILY_COUNTRY, when=_tavily_country_applies),
            }
        ),
        # exa-py 2.28 (its snake_case options go out camelCased).
        "exa": VendorOptions(
            {
                "time_range": OptionField("startPublishedDate", _iso_start, _read_start),
                "include_domains": _domain_field("includeDomains"),
                "exclude_domains": _domain_field("excludeDomains", _exa_excludes),
                "topic": OptionField("category", *_NEWS_OR_OMIT),
                "country": OptionField("userLocation", read=_read_exa_location),
                "safe_search": OptionField("moderation", read=_read_bool),
            }
        ),
        # Brave web search; news is another endpoint, so topic news is dropped here.
        "brave": VendorOptions(
            {
                "time_range": OptionField("freshness", _BRAVE_FRESHNESS[0], _read_brave_freshness),
                "country": OptionField("country", _brave_country, _read_code),
                "language": OptionField("search_lang", *_BRAVE_LANG),
                "safe_search": OptionField("safesearch", _BRAVE_SAFE[0], _read_brave_safe),
            },
            news_paths=("/res/v1/news/search",),
        ),
        # Serper's /search (news is its /news endpoint).
        "serper": VendorOptions(
            {
                "time_range": OptionField("tbs", _qdr, _read_qdr),
                "country": OptionField("gl", _lower, _read_code),
                "language": OptionField("hl", read=_read_code),
            },
            news_paths=("/news",),
        ),
        "serpapi": VendorOptions(
            {
                "time_range": OptionField("tbs", _qdr, _read_qdr),
                "country": OptionField("gl", _lower, _read_code),
                "language": OptionField("hl", read=_read_code),
                "safe_search": OptionField("safe", *_SERPAPI_SAFE),
                "topic": OptionField("tbm", *_SERPAPI_TBM),
            }
        ),
        # scavio 0.28, endpoint google_search (/api/v2/google).
        "scavio": VendorOptions(
            {
                "time_range": OptionField("time_period", *_SCAVIO_PERIOD),
                "country": OptionField("gl", _lower, _read_code),
                "language": OptionField("hl", read=_read_code),
                "safe_search": OptionField("safe", _scavio_safe, _read_scavio_safe),
            }
        ),
        "searxng": VendorOptions(
            {
                "time_range": OptionField("time_range", *_table({r: r for r in TIME_RANGES})),
                "language": OptionField("language", read=_read_searxng_language),
                "safe_search": OptionField("safesearch", *_SEARXNG_SAFE),
                "topic": OptionField("categories", _TOPIC_SAME[0], _read_searxng_categories),
            }
        ),
        # linkup-sdk 0.24.
        "linkup": VendorOptions(
            {
                "time_range": OptionField("fromDate", _date_start, _read_start),
                "include_domains": _domain_field("includeDomains"),
                "exclude_domains": _domain_field("excludeDomains"),
            }
        ),
        # s.jina.ai's parameters (jina-ai/reader's searcher): `site` adds site: operators.
        "jina": VendorOptions(
            {
                "include_domains": _domain_field("site"),
                "country": OptionField("gl", _lower, _read_code),
                "language": OptionField("hl", read=_read_code),
                "topic": OptionField("type", *_table({"news": "news", "general": "web"})),
            }
        ),
        # Firecrawl v2 /search.
        "firecrawl": VendorOptions(
            {
                "time_range": OptionField("tbs", _qdr, _read_qdr),
                "country": OptionField("country", read=_read_code),
                "topic": OptionField("sources", _firecrawl_sources, _read_firecrawl_sources),
            }
        ),
    }
)


def vendor_options(profile: VendorProfile) -> VendorOptions:
    """The option table for a profile: its vendor's, or its family's for a custom profile that
    extends one; an empty one (every option dropped) otherwise."""
    return VENDOR_OPTIONS.get(profile.dialect, _NO_OPTIONS)


_NO_OPTIONS = VendorOptions({})


def _utc(now: datetime | None) -> datetime:
    if now is None:
        return datetime.now(UTC)
    return now if now.tzinfo is not None else now.replace(tzinfo=UTC)


def _param(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def apply_options(
    profile: VendorProfile,
    request: SearchRequest,
    options: SearchOptions,
    *,
    now: datetime | None = None,
) -> tuple[SearchRequest, tuple[str, ...]]:
    """`request` with every option the vendor can honour written into it, and the names of the
    options it cannot (in OPTION_NAMES order). max_results is left to the request builder.

    `now` is the time relative ranges count back from (default: the current time); GET requests
    carry options as query parameters, POST requests as top-level JSON body fields.
    """
    table = vendor_options(profile)
    now = _utc(now)
    params = dict(request.query_params)
    body = dict(request.json_body) if request.json_body is not None else None
    dropped: list[str] = []
    for name in options.requested():
        value = getattr(options, name)
        spec = table.fields.get(name)
        if spec is None:
            if not (name == "topic" and value == "general"):
                dropped.append(name)
            continue
        wire = spec.write(value, now) if spec.when is None or spec.when(options) else None
        if wire is None:
            dropped.append(name)
        elif wire is not OMIT:
            if body is None:
                params[spec.field] = _param(wire)
            else:
                body[spec.field] = wire
    built = dataclasses.replace(request, query_params=params, json_body=body)
    return built, tuple(dropped)


def read_options(
    profile: VendorProfile,
    method: str,
    path: str,
    query_params: Mapping[str, str],
    body: bytes,
    *,
    now: datetime | None = None,
) -> SearchOptions:
    """The unified options an agent's request in this vendor's own shape asks for.

    The inverse of the vendor's table where it is well defined: values with no unified
    equivalent (Brave `safesearch=moderate`, a Tavily `finance` topic) and anything malformed
    are left unset; never raises. A body is read for methods other than GET, as a JSON object
    or else a form; its fields win over query parameters of the same name.
    """
    now = _utc(now)
    source: dict[str, Any] = dict(query_params)
    if method.upper() != "GET" and body:
        source.update(_body_fields(body))
    table = vendor_options(profile)
    found: dict[str, Any] = {}
    if profile.max_results_field and profile.max_results_field in source:
        found["max_results"] = _read_count(source[profile.max_results_field])
    for name, spec in table.fields.items():
        if spec.field in source:
            found[name] = spec.read(source[spec.field], now)
    if any(path.endswith(suffix) for suffix in table.news_paths):
        found["topic"] = "news"
    valid: dict[str, Any] = {}
    for name, value in found.items():
        if value is None:
            continue
        try:
            SearchOptions(**{name: value})
        except OptionError:
            continue
        valid[name] = value
    return SearchOptions(**valid)


def _body_fields(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        try:
            return dict(parse_qsl(body.decode("utf-8"), keep_blank_values=True))
        except (UnicodeDecodeError, ValueError):
            return {}
    return data if isinstance(data, dict) else {}


def _read_count(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None

"""Tavily (POST /search, `query` in the body, `results[]` with `content`): its whole record,
its extract API (POST /extract) and the preset of its remote MCP server
(https://mcp.tavily.com/mcp/)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from policies.core.errors import ProxyError
from policies.core.extract import (
    ExtractAnswer,
    ExtractApi,
    ExtractRequest,
    PageFormat,
    PageMiss,
    PageRead,
    object_of,
    text_of,
)
from policies.core.options import OptionField, SearchOptions, VendorOptions, domain_field, table
from policies.core.profile import (
    AnswerTemplate,
    CredentialSlot,
    DetailFields,
    HealthCall,
    McpPreset,
    QueryLocation,
    VendorProfile,
)

# `country` is a lower-case English name from a fixed list (Tavily's OpenAPI enum).
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


def _country_applies(options: SearchOptions) -> bool:
    return options.topic != "news"  # Tavily's country only applies to general searches


def _error_body(err: ProxyError, request_id: str) -> dict[str, Any]:
    # Never an `error.code` here: tavily-python reads that as its keyless-limit error.
    return {"detail": {"error": err.message}}


def _extract(urls: tuple[str, ...], fmt: PageFormat, max_chars: int) -> ExtractRequest:
    # No length parameter: Tavily answers whole pages, cut by the proxy.
    body = {"urls": list(urls), "format": fmt, "extract_depth": "basic"}
    return ExtractRequest("POST", "/extract", body)


def _read_extract(data: Any, urls: tuple[str, ...], fmt: PageFormat) -> ExtractAnswer:
    """`results[]` url/raw_content (a title on newer answers), `failed_results[]` url/error."""
    data = object_of(data)
    pages = tuple(
        PageRead(text_of(r.get("url")), text_of(r.get("title")), text_of(r.get("raw_content")), fmt)
        for r in data.get("results") or ()
        if isinstance(r, dict) and text_of(r.get("raw_content"))
    )
    misses = tuple(
        PageMiss(text_of(f.get("url")), text_of(f.get("error")) or "failed")
        for f in data.get("failed_results") or ()
        if isinstance(f, dict)
    )
    return ExtractAnswer(pages, misses)


TAVILY = VendorProfile(
    name="tavily",
    query_locations=(QueryLocation("json", "query"),),
    results_paths=(("results",),),
    snippet_fields=("content",),
    terminal_statuses=frozenset({432, 433}),  # plan / pay-as-you-go limit
    error_code_paths=(("detail", "error"),),
    search_path="/search",
    max_results_field="max_results",
    max_results_cap=20,
    key_slot=CredentialSlot("header", "Authorization", "Bearer "),
    key_fields=("api_key",),
    # tavily-python 0.8.5 and Tavily's OpenAPI document. Its SDK also sends `language`, in a
    # format not documented there: dropped rather than guessed.
    options=VendorOptions(
        {
            "time_range": OptionField(
                "time_range",
                *table({"day": "day|d", "week": "week|w", "month": "month|m", "year": "year|y"}),
            ),
            "include_domains": domain_field("include_domains"),
            "exclude_domains": domain_field("exclude_domains"),
            "topic": OptionField("topic", *table({"general": "general", "news": "news"})),
            "country": OptionField("country", *table(TAVILY_COUNTRIES), when=_country_applies),
        }
    ),
    details=DetailFields(score=("score",), published=("published_date",)),  # dates: news only
    answer=AnswerTemplate(
        envelope={
            "query": "$query",
            "follow_up_questions": None,
            "answer": None,
            "images": [],
            "response_time": 0.0,
        },
        extra={"score": None, "raw_content": None},
    ),
    error_shape=_error_body,
    # Read-only web tools; a search answers `{"results": [...]}` as JSON text in
    # `content[0].text`.
    mcp=McpPreset(
        idempotent_tools=("tavily_search", "tavily_extract", "tavily_map", "tavily_crawl"),
        search_tools={"tavily_search": "query"},
    ),
    # Up to 20 URLs a call (Tavily's documented limit).
    extract=ExtractApi(batch=20, build=_extract, read=_read_extract),
    # The key's and account's usage (GET /usage): no credits spent, so the breaker may probe it
    # every second while searches fail.
    health=HealthCall("GET", "/usage"),
)

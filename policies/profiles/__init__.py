"""Vendor profiles: where each search API keeps the query, the results and its error codes.

Plain data plus pure functions (no I/O), shared by the search-recovery policy and the tests.
"""

from policies.core.profile import (
    QUERY_KINDS,
    Assessment,
    ProfileError,
    QueryKind,
    QueryLocation,
    QueryRef,
    RateLimitHint,
    SearchRequest,
    SearchResult,
    VendorProfile,
    Verdict,
)
from policies.profiles.assess import assess, classify, error_message, ratelimit_hint
from policies.profiles.details import ResultDetails, extract_details
from policies.profiles.options import (
    OPTION_NAMES,
    TIME_RANGES,
    TOPICS,
    OptionError,
    SearchOptions,
    apply_options,
    read_options,
)
from policies.profiles.query import (
    build_search,
    build_search_request,
    credential_slot,
    extract_query,
    replace_query,
    with_credential,
)
from policies.profiles.render import render_answer
from policies.profiles.results import extract_results, normalize_results
from policies.profiles.vendors import BUILTIN_PROFILES

__all__ = [
    "BUILTIN_PROFILES",
    "OPTION_NAMES",
    "QUERY_KINDS",
    "TIME_RANGES",
    "TOPICS",
    "Assessment",
    "OptionError",
    "ProfileError",
    "QueryKind",
    "QueryLocation",
    "QueryRef",
    "RateLimitHint",
    "ResultDetails",
    "SearchOptions",
    "SearchRequest",
    "SearchResult",
    "VendorProfile",
    "Verdict",
    "apply_options",
    "assess",
    "build_search",
    "build_search_request",
    "classify",
    "credential_slot",
    "error_message",
    "extract_details",
    "extract_query",
    "extract_results",
    "normalize_results",
    "ratelimit_hint",
    "read_options",
    "render_answer",
    "replace_query",
    "with_credential",
]

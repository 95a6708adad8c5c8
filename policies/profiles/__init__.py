"""Vendor profiles: where each search API keeps the query, the results and its error codes.

Plain data plus pure functions (no I/O), shared by the search-recovery policy and the tests.
"""

from policies.profiles.assess import assess, classify, error_message, ratelimit_hint
from policies.profiles.model import (
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
from policies.profiles.query import build_search_request, extract_query, replace_query
from policies.profiles.results import extract_results, normalize_results
from policies.profiles.vendors import BUILTIN_PROFILES

__all__ = [
    "BUILTIN_PROFILES",
    "QUERY_KINDS",
    "Assessment",
    "ProfileError",
    "QueryKind",
    "QueryLocation",
    "QueryRef",
    "RateLimitHint",
    "SearchRequest",
    "SearchResult",
    "VendorProfile",
    "Verdict",
    "assess",
    "build_search_request",
    "classify",
    "error_message",
    "extract_query",
    "extract_results",
    "normalize_results",
    "ratelimit_hint",
    "replace_query",
]

"""Reading and writing requests and answers by a vendor's record: where it keeps the query and
the results, what an answer means, its options, details and answer shape. Pure functions (no
I/O), each taking the record (policies/vendors/ holds the built-ins), never a vendor's name.
"""

from policies.core.options import OPTION_NAMES, TIME_RANGES, TOPICS, OptionError, SearchOptions
from policies.core.profile import (
    QUERY_KINDS,
    Assessment,
    CredentialSlot,
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
from policies.profiles.options import apply_options, read_options
from policies.profiles.query import (
    body_keys,
    build_search,
    build_search_request,
    extract_query,
    replace_query,
    request_query,
    set_param,
    with_body_key,
    with_credential,
)
from policies.profiles.render import render_answer
from policies.profiles.results import extract_results, normalize_results
from policies.vendors import BUILTIN as BUILTIN_PROFILES

__all__ = [
    "BUILTIN_PROFILES",
    "OPTION_NAMES",
    "QUERY_KINDS",
    "TIME_RANGES",
    "TOPICS",
    "Assessment",
    "CredentialSlot",
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
    "body_keys",
    "build_search",
    "build_search_request",
    "classify",
    "error_message",
    "extract_details",
    "extract_query",
    "extract_results",
    "normalize_results",
    "ratelimit_hint",
    "read_options",
    "render_answer",
    "replace_query",
    "request_query",
    "set_param",
    "with_body_key",
    "with_credential",
]

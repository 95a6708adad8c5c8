"""What a vendor's answer means: verdicts for search recovery and retries, the error code in
its body, and the rate-limit window its headers announce."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from policies.core.profile import Assessment, RateLimitHint, VendorProfile, Verdict
from policies.profiles.reading import MISSING, NOT_A_LIST, NOT_JSON, dig, find_results, load_json

# Reset values this large are Unix timestamps, not "seconds from now".
_EPOCH_THRESHOLD = 1_000_000_000.0


def _error_code(profile: VendorProfile, data: Any) -> str | None:
    for path in profile.error_code_paths:
        value = dig(data, path)
        if isinstance(value, str) and value:
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
    return None


def assess(profile: VendorProfile, status: int, body: bytes) -> Assessment:
    """Classify a vendor answer and report the error code its body carries, if any.

    Order: terminal status or body code; empty status+code (e.g. Linkup 400); other non-2xx
    pass; a 2xx is MALFORMED when it is not JSON (unless `non_json_ok`) or its result list is
    missing (unless `missing_results_is_empty`) or not a list, EMPTY when the list is empty
    or `empty_when_body_field` is present, else OK.
    """
    data = load_json(body)
    code = _error_code(profile, data) if data is not NOT_JSON else None
    if status in profile.terminal_statuses or code in profile.terminal_body_codes.get(status, ()):
        return Assessment(Verdict.TERMINAL, code)
    if code in profile.empty_status_codes.get(status, ()):
        return Assessment(Verdict.EMPTY, code)
    if not 200 <= status < 300:
        return Assessment(Verdict.PASS, code)
    if data is NOT_JSON:
        return Assessment(Verdict.OK if profile.non_json_ok else Verdict.MALFORMED)
    if not isinstance(data, dict) and all(profile.results_paths):
        return Assessment(Verdict.MALFORMED)
    results = find_results(profile, data)
    if results is NOT_A_LIST:
        return Assessment(Verdict.MALFORMED, code)
    if results is not MISSING and results:
        return Assessment(Verdict.OK, code)
    field = profile.empty_when_body_field
    if results is not MISSING or profile.missing_results_is_empty:
        return Assessment(Verdict.EMPTY, code)
    if field is not None and isinstance(data, dict) and field in data:
        return Assessment(Verdict.EMPTY, code)
    return Assessment(Verdict.MALFORMED, code)


# Where vendors put the sentence of an error body: Tavily detail.error, Linkup/Scavio/Brave
# error.message or error.detail, Exa/SerpAPI/Firecrawl error, Serper/Jina message, FastAPI detail.
_MESSAGE_PATHS: tuple[tuple[str, ...], ...] = (
    ("detail", "error"),
    ("error", "message"),
    ("error", "detail"),
    ("error",),
    ("message",),
    ("detail",),
)
MAX_VENDOR_MESSAGE = 200


def error_message(body: bytes) -> str | None:
    """The vendor's own sentence in an error body, cut to one short line; None if none."""
    data = load_json(body)
    if not isinstance(data, dict):
        return None
    for path in _MESSAGE_PATHS:
        value = dig(data, path)
        if isinstance(value, str) and value.strip():
            # One printable line: the vendor's words end up in status lines and logs.
            text = "".join(c if c.isprintable() else " " for c in " ".join(value.split()))
            return text if len(text) <= MAX_VENDOR_MESSAGE else text[:MAX_VENDOR_MESSAGE] + "..."
    return None


def classify(profile: VendorProfile, status: int, body: bytes) -> Verdict:
    """The verdict alone; see `assess` for the rules and the error code."""
    return assess(profile, status, body).verdict


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        # Plain dicts are case-sensitive; CIMultiDict answers above already.
        value = next((v for k, v in headers.items() if k.lower() == name.lower()), None)
    return value


def ratelimit_hint(
    profile: VendorProfile, headers: Mapping[str, str], *, now: float | None = None
) -> RateLimitHint | None:
    """Read X-RateLimit-Remaining/-Reset; None when the vendor sends none or they do not parse.

    Brave sends comma-separated windows (per second, per month). The binding window is the
    exhausted one with the longest reset if any is exhausted, else the one with the fewest
    requests left (the first on ties, i.e. the per-second window). A reset that looks like a
    Unix timestamp is converted with `now` (wall-clock seconds), or ignored without it.
    """
    if not profile.ratelimit_headers:
        return None
    remaining_raw = _header(headers, "X-RateLimit-Remaining")
    reset_raw = _header(headers, "X-RateLimit-Reset")
    if remaining_raw is None or reset_raw is None:
        return None
    try:
        remaining = [int(v.strip()) for v in remaining_raw.split(",")]
        resets = [float(v.strip()) for v in reset_raw.split(",")]
    except ValueError:
        return None
    windows: list[tuple[int, float]] = []
    for left, reset in zip(remaining, resets, strict=False):
        if not math.isfinite(reset) or reset < 0 or left < 0:
            return None
        if reset >= _EPOCH_THRESHOLD:
            if now is None:
                return None
            reset = max(0.0, reset - now)
        windows.append((left, reset))
    if not windows:
        return None
    exhausted = [w for w in windows if w[0] == 0]
    left, reset = (
        max(exhausted, key=lambda w: w[1]) if exhausted else min(windows, key=lambda w: w[0])
    )
    return RateLimitHint(left, reset)

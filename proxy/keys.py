"""Keys a request carries in its JSON body, where a vendor's profile reads one (Tavily's
`api_key`): read to recognise a client token there, removed with it, and replaced by the
route's own key when the route injects one, so the vendor sees one key, the route's."""

from __future__ import annotations

from dataclasses import replace

from policies.core.flow import Request
from policies.core.profile import VendorProfile
from policies.profiles import with_body_key


def injected_key(
    profile: VendorProfile | None, set_headers: tuple[tuple[str, str], ...]
) -> str | None:
    """The key a route puts where its vendor reads one (its `headers.set` value for the
    profile's key header, less the scheme), or None when it injects none."""
    slot = profile.key_slot if profile is not None else None
    if slot is None or slot.kind != "header":
        return None
    for name, value in set_headers:
        if name.lower() == slot.name.lower():
            if value[: len(slot.prefix)].lower() == slot.prefix.lower():
                return value[len(slot.prefix) :].strip() or None
    return None


def one_key(profile: VendorProfile | None, key: str | None, request: Request) -> Request:
    """`request` with the body's key fields holding `key` (the route's own), so a vendor that
    reads a key from both places never sees the agent's beside the route's."""
    if profile is None or key is None or not profile.key_fields:
        return request
    body = with_body_key(request.body, profile.key_fields, key)
    return request if body is request.body else replace(request, body=body)

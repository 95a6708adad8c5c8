"""Writing results back in a vendor's own answer shape, so a vendor's SDK parses results that
another vendor found (cross-vendor failover) exactly as it parses its own.

The vendor's record holds the answer's fixed envelope and each result's extra fields, with
`$name` placeholders filled per answer or per result. The result list goes where the profile
reads it (its first results path) and carries the profile's first url, title and snippet field
names, so a custom profile without a template still gets a body its own reader accepts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from policies.core.profile import SearchResult, VendorProfile


def _fill(node: Any, values: Mapping[str, Any]) -> Any:
    if isinstance(node, str) and node.startswith("$"):
        return values.get(node[1:], node)
    if isinstance(node, Mapping):
        return {k: _fill(v, values) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(v, values) for v in node]
    return node


def render_answer(profile: VendorProfile, results: Sequence[SearchResult], query: str) -> Any:
    """An answer body (JSON data) in `profile`'s vendor shape carrying `results`."""
    envelope, extra = profile.answer.envelope, profile.answer.extra
    items = []
    for position, result in enumerate(results, start=1):
        fields = {"url": result.url, "title": result.title, "snippet": result.snippet}
        item = _fill(extra, {**fields, "position": position})
        item[profile.url_fields[0]] = result.url
        item[profile.title_fields[0]] = result.title
        item[profile.snippet_fields[0]] = result.snippet
        items.append(item)
    body: dict[str, Any] = _fill(envelope, {"query": query, "count": len(items)})
    path = profile.results_path
    if not path:  # the body itself is the list: no envelope fits
        return items
    target = body
    for key in path[:-1]:
        nested = target.setdefault(key, {})
        target = nested if isinstance(nested, dict) else target
    target[path[-1]] = items
    return body

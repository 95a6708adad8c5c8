"""The depth check on agents' JSON bodies (proxy/bodies.py): deep nesting is found wherever it
sits, brackets inside strings do not count, and a wide body at the limit passes."""

from __future__ import annotations

import pytest

from proxy.bodies import MAX_JSON_DEPTH, nested_deeper


@pytest.mark.parametrize(
    "body",
    [
        b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1),
        b'{"a":' * 5000 + b"1" + b"}" * 5000,
        b'{"q": "x", "deep": ' + b"[" * 100 + b"]" * 100 + b"}",
        b'{"a": "\\"]]]", "b": ' + b"[" * 70 + b"]" * 70 + b"}",  # an escaped quote, then depth
    ],
)
def test_nesting_past_the_limit_is_found(body: bytes) -> None:
    assert nested_deeper(body)


@pytest.mark.parametrize(
    "body",
    [
        b'{"query": "x", "max_results": 5}',
        b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH,
        b'{"q": "' + b"[" * 1000 + b'"}',  # brackets inside a string
        b"[" + b"[]," * 100_000 + b"[]]",  # wide, not deep
        b"[" + (b"[" * 62 + b"1" + b"]" * 62 + b",") * 8000 + b"1]",  # wide at the limit
        b"query=[[[[",  # not JSON at all
    ],
)
def test_bodies_within_the_limit_pass(body: bytes) -> None:
    assert not nested_deeper(body)

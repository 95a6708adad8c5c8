"""Reading an agent's request body, the one way every endpoint does: bounded in size
(server.max_body_bytes) and, for JSON, in depth, so no parser down the line (an SDK's
recursive json.loads, the cache key's canonical form) meets a body built to exhaust it."""

from __future__ import annotations

import re
from itertools import accumulate, repeat
from operator import sub
from typing import Any

import orjson
from aiohttp import web

from policies.core.errors import BadRequest
from policies.core.memory import holding
from proxy.budget import charge_body
from proxy.errors import PayloadTooLarge

# No search, fetch or MCP request nests anywhere near this; an SDK's json.loads fails at ~1000.
MAX_JSON_DEPTH = 64
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
# An opener becomes 2 and a closer 0, so that each minus 1 is the step in depth.
_STEP = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")


def nested_deeper(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether JSON `body` nests arrays and objects more than `limit` deep, by the running
    count of brackets outside strings (a pure check; a few ms for a body of 1 MiB of brackets,
    nothing for one with fewer than `limit`). Text that is not JSON answers False or True
    harmlessly: its parser refuses it anyway."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    steps = _STRING.sub(b"", body).translate(_STEP, _NOT_BRACKET)
    return max(accumulate(map(sub, steps, repeat(1))), default=0) > limit


def too_deep(where: str) -> BadRequest:
    return BadRequest(
        f"{where}: the JSON body nests deeper than {MAX_JSON_DEPTH} levels; send a flatter body"
    )


async def read_body(request: web.Request, limit: int, where: str = "request") -> bytes:
    """The whole body, at most `limit` bytes (PayloadTooLarge past it); a JSON body (one that
    starts with `{` or `[`) nested past MAX_JSON_DEPTH is a BadRequest."""
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(
            f"request body of {request.content_length} bytes exceeds the "
            f"limit of {limit} bytes; send a smaller request"
        )
    hold = holding()  # the body counts against the memory budget, refused before it is read
    declared = request.content_length
    if declared:
        charge_body(hold, declared, where)
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        body = None
    if body is None or len(body) > limit:
        raise PayloadTooLarge(
            f"request body exceeds the limit of {limit} bytes; send a smaller request"
        )
    if not declared:
        charge_body(hold, len(body), where)
    if body.lstrip()[:1] in (b"{", b"[") and nested_deeper(body):
        raise too_deep(where)
    return body


async def read_json(request: web.Request, where: str, route: str) -> Any:
    """The whole body as JSON (an endpoint of the proxy's own: `where`, counted as `route`),
    bounded as every body is: client_max_size is server.max_body_bytes + 1 (proxy/app.py)."""
    raw = await read_body(request, request.client_max_size - 1, where)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequest(f"{where}: body is not valid JSON", route=route) from None

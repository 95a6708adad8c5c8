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
from aiohttp.web_protocol import RequestPayloadError

from policies.core.errors import BadRequest
from policies.core.memory import Hold, holding
from proxy.budget import charge_body, charge_parse
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


def inflated(request: web.BaseRequest | Any) -> bool:
    """Whether the body read is not the bytes the agent sent: aiohttp's server decodes a body
    as it reads it when its parser chose a compression for it, and it is the parser's choice
    that counts (given Content-Encoding twice, the C parser takes the last, the pure-Python one
    the first); proxy/front.py's path never decodes. `_message` is checked at start-up
    (proxy/internals.py)."""
    if not isinstance(request, web.BaseRequest):
        return False
    return request._message.compression is not None


def too_deep(where: str) -> BadRequest:
    return BadRequest(
        f"{where}: the JSON body nests deeper than {MAX_JSON_DEPTH} levels; send a flatter body"
    )


async def read_body(request: web.Request, limit: int, where: str = "request") -> bytes:
    """The whole body, at most `limit` bytes (PayloadTooLarge past it), counted against the
    memory budget before it is held; a JSON body (one that starts with `{` or `[`) nested past
    MAX_JSON_DEPTH is a BadRequest, and so is one that cannot be read as sent."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise PayloadTooLarge(
            f"request body of {declared} bytes exceeds the "
            f"limit of {limit} bytes; send a smaller request"
        )
    hold = holding()
    if isinstance(request, web.BaseRequest) and (declared is None or inflated(request)):
        # Chunked, or inflated by aiohttp: the length says nothing of the bytes it will hold.
        body = await _read_counted(request, limit, hold, where)
    else:
        if declared:  # refused before it is read
            charge_body(hold, declared, where)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(limit) from None
        except RequestPayloadError as exc:
            raise _unreadable(request, where, exc) from None
    if body.lstrip()[:1] in (b"{", b"[") and nested_deeper(body):
        raise too_deep(where)
    charge_parse(hold, body, where)
    return body


async def _read_counted(
    request: web.BaseRequest, limit: int, hold: Hold | None, where: str
) -> bytes:
    """The body as it comes, each piece counted against the memory budget before it is kept."""
    pieces: list[bytes] = []
    size = 0
    try:
        while piece := await request.content.readany():
            size += len(piece)
            if size > limit:
                raise _too_large(limit)
            charge_body(hold, len(piece), where)
            pieces.append(piece)
    except RequestPayloadError as exc:
        raise _unreadable(request, where, exc) from None
    return b"".join(pieces)


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"request body exceeds the limit of {limit} bytes; send a smaller request"
    )


def _unreadable(request: web.BaseRequest, where: str, exc: RequestPayloadError) -> BadRequest:
    """A body that ends early or does not decode as its Content-Encoding says. Its connection
    closes once answered: aiohttp would otherwise read on past the answer for the rest, meet
    the same error and log it with its traceback."""
    if request.protocol is not None:
        request.protocol._lingering_time = 0.0  # as proxy/guard.py does for a late body
    return BadRequest(
        f"{where}: the request body cannot be read as sent ({exc}); send it whole, "
        "uncompressed or compressed as its Content-Encoding says"
    )


async def read_json(request: web.Request, where: str, route: str) -> Any:
    """The whole body as JSON (an endpoint of the proxy's own: `where`, counted as `route`),
    bounded as every body is: client_max_size is server.max_body_bytes + 1 (proxy/app.py)."""
    raw = await read_body(request, request.client_max_size - 1, where)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequest(f"{where}: body is not valid JSON", route=route) from None

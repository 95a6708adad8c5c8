"""The private parts of aiohttp that proxy/guard.py builds every connection limit on, that
proxy/outbound.py reads upstream answers with, and that proxy/bodies.py learns from whether a
request body was inflated, checked at start-up: an aiohttp that moved one would leave the limits
silently off, every vendor call failing or a body sent on mislabelled, so the proxy refuses to
start and names what is missing instead."""

from __future__ import annotations

import asyncio
from types import ModuleType
from typing import Any

import aiohttp
from aiohttp import client_proto, http_parser, web, web_protocol, web_runner

# Names of the per-connection protocol (RequestHandler and its BaseProtocol): slots read and
# written by ClientConnection, and the methods it overrides or calls.
HANDLER_NAMES = (
    "_messages",
    "_request_count",
    "_request_in_progress",
    "_lingering_time",
    "_reading_paused",
    "_buffer_paused",
    "_paused",
    "_loop",
    "_drain_helper",
    "data_received",
    "connection_made",
    "connection_lost",
    "finish_response",
    "handle_error",
    "force_close",
    "log_exception",
)
# Attributes a Server sets in its __init__ that GuardedServer copies from AppRunner's.
SERVER_NAMES = ("_kwargs", "request_handler", "request_factory", "handler_cancellation")
RUNNER_NAMES = ("_make_server",)
MODULE_NAMES = ("ERROR",)  # aiohttp.web_protocol.ERROR: its stand-in for an unparsed request
# What proxy/outbound.py calls on aiohttp's client protocol (ResponseHandler) for each request.
RESPONSE_NAMES = ("set_response_params", "read", "should_close", "is_connected", "close")
# What proxy/bodies.py reads to know whether aiohttp's server inflated a request body: the
# parsed message a request keeps, and the compression its parser chose for it.
REQUEST_NAMES = ("_message",)
MESSAGE_NAMES = ("compression",)


def _server_attributes(server: type[Any]) -> set[str]:
    """The attributes a Server instance has once built (set in __init__, not on the class)."""

    async def noop(request: Any) -> Any:
        return None

    loop = asyncio.new_event_loop()
    try:
        built = server(noop, loop=loop)
        return set(vars(built)) | set(dir(server))
    finally:
        loop.close()


def missing_internals(
    handler: type[Any] = web_protocol.RequestHandler,
    server: type[Any] = web.Server,
    runner: type[Any] = web_runner.AppRunner,
    module: ModuleType = web_protocol,
    response: type[Any] = client_proto.ResponseHandler,
    request: type[Any] = web.BaseRequest,
    message: type[Any] = http_parser.RawRequestMessage,
) -> list[str]:
    """The private names guard.py, outbound.py and bodies.py rely on that this aiohttp lacks
    (empty: all there)."""
    missing = [f"{handler.__name__}.{n}" for n in HANDLER_NAMES if not hasattr(handler, n)]
    has = _server_attributes(server)
    missing += [f"{server.__name__}.{n}" for n in SERVER_NAMES if n not in has]
    missing += [f"{runner.__name__}.{n}" for n in RUNNER_NAMES if not hasattr(runner, n)]
    missing += [f"{module.__name__}.{n}" for n in MODULE_NAMES if not hasattr(module, n)]
    missing += [f"{response.__name__}.{n}" for n in RESPONSE_NAMES if not hasattr(response, n)]
    kept: frozenset[str] = getattr(request, "ATTRS", frozenset())  # its instances' attributes
    missing += [f"{request.__name__}.{n}" for n in REQUEST_NAMES if n not in kept]
    missing += [f"{message.__name__}.{n}" for n in MESSAGE_NAMES if not hasattr(message, n)]
    return missing


def internals_problem() -> str | None:
    """Why this aiohttp cannot serve with the proxy's connection limits and its upstream
    connections, or None."""
    missing = missing_internals()
    if not missing:
        return None
    return (
        f"aiohttp {aiohttp.__version__} lacks what proxy/guard.py's connection limits, "
        "proxy/outbound.py's upstream connections and proxy/bodies.py's body reading rely on "
        f"({', '.join(missing)}); refusing to serve without them: install the aiohttp version "
        "pyproject.toml pins (pip install 'aiohttp>=3.14,<3.15')"
    )

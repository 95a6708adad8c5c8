"""A worker among several (`server.workers` above 1, started by proxy/supervisor.py): what it
knows of its fleet, the unix socket its siblings reach it on, the admin calls worker 0 passes on
to all of them, and /metrics added up over the fleet on whichever worker a scrape reaches."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import generate_latest

from policies.core.errors import ProxyError
from proxy.admin import AdminHandler
from proxy.dialects import error_response
from proxy.fleetmetrics import families, fleet_exposition, write_snapshot
from proxy.metrics import Metrics
from proxy.reload import RELOADER
from proxy.state import STATE
from proxy.supervisor import Fleet

ASK_TIMEOUT_S = 5.0  # a sibling's answer: one reload at most (snapshots take milliseconds)
# Admin calls that act on a worker's own state: worker 0 makes them on every worker.
_RELOAD = ("POST", "/admin/reload")
FANNED_OUT = ("reset_breaker", "clear_cache")


async def ask(fleet: Fleet, index: int, method: str, path: str) -> tuple[int, Any] | None:
    """Call worker `index` over its socket; None when it does not answer (restarting)."""
    connector = aiohttp.UnixConnector(path=str(fleet.socket(index)))
    timeout = aiohttp.ClientTimeout(total=ASK_TIMEOUT_S)
    try:
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
            session.request(method, f"http://worker{path}") as answer,
        ):
            return answer.status, orjson.loads(await answer.read())
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
        return None


async def snapshot(fleet: Fleet, metrics: Metrics) -> None:
    """Write this worker's metrics where a scrape adds them up."""
    found = families(metrics.registry)  # here: collectors bring their counters up to date
    await asyncio.to_thread(write_snapshot, fleet.run_dir, fleet.index, found)


async def exposition(fleet: Fleet, metrics: Metrics) -> bytes:
    """The fleet's /metrics: every worker snapshots its own (one that does not answer counts
    with its last snapshot), then the snapshots are added up."""
    asked = (ask(fleet, i, "POST", "/fleet/snapshot") for i in fleet.siblings)
    try:
        await asyncio.gather(snapshot(fleet, metrics), *asked)
        return await asyncio.to_thread(fleet_exposition, fleet.run_dir, fleet.workers)
    except OSError:  # the run directory is gone: the supervisor is exiting
        return generate_latest(metrics.registry)


def fan_out(fleet: Fleet) -> Middleware:
    """For worker 0's admin listener: an admin call that acts on the worker's own state
    (reload, breaker reset, cache purge) is made on every worker, and answered for all."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        name = request.match_info.route.name
        reload = (request.method, request.path) == _RELOAD
        if not (reload or name in FANNED_OUT) or not isinstance(response, web.Response):
            return response
        if response.status != 200 and not (reload and response.status == 422):
            return response  # refused (token, unknown route): the same everywhere
        assert isinstance(response.body, bytes)
        asked = [ask(fleet, i, request.method, request.raw_path) for i in fleet.siblings]
        answers = dict(zip(fleet.siblings, await asyncio.gather(*asked), strict=True))
        answers[fleet.index] = (response.status, orjson.loads(response.body))
        combined = combine_reloads(answers) if reload else combine_admin(name or "", answers)
        status = 422 if combined.get("result") == "failed" else 200
        body = orjson.dumps(combined)
        return web.Response(status=status, body=body, content_type="application/json")

    return middleware


def _in_order(answers: Mapping[int, tuple[int, Any] | None]) -> list[tuple[int, Any]]:
    """(worker, its answer's body or None) by worker."""
    return [(i, answer[1] if (answer := answers[i]) else None) for i in sorted(answers)]


def combine_reloads(answers: Mapping[int, tuple[int, Any] | None]) -> dict[str, Any]:
    """One answer for a reload of every worker: the first worker's report, `result` the fleet's
    (failed if any worker failed, applied if any applied), and each worker's own under
    `workers` (`unreachable`: it was restarting, and starts on what the others applied)."""
    workers = []
    for index, report in _in_order(answers):
        if report is None:
            workers.append({"worker": index, "result": "unreachable"})
        else:
            keep = ("result", "hash", "errors")
            workers.append({"worker": index, **{k: report.get(k) for k in keep}})
    results = {w["result"] for w in workers}
    first = next(report for _, report in _in_order(answers) if report is not None)
    result = "failed" if "failed" in results else "applied" if "applied" in results else "unchanged"
    return {**first, "result": result, "workers": workers}


def combine_admin(name: str, answers: Mapping[int, tuple[int, Any] | None]) -> dict[str, Any]:
    """One answer for a breaker reset or a cache purge made on every worker."""
    workers: list[dict[str, Any]] = []
    for index, body in _in_order(answers):
        if body is None:
            workers.append({"worker": index, "error": "unreachable"})
        elif name == "clear_cache":
            workers.append({"worker": index, "local": body.get("local")})
        else:
            workers.append({"worker": index, "state": body.get("state")})
    first = next(body for _, body in _in_order(answers) if body is not None)
    if name == "clear_cache":
        local = sum(w.get("local") or 0 for w in workers)
        return {**first, "local": local, "workers": workers}
    return {**first, "workers": workers}


# ---------------------------------------------------------------------------------------------
# The worker's own socket: what its siblings ask of it, with no token (the run directory is
# the user's alone).


def _own(handler: AdminHandler) -> AdminHandler:
    async def answer(request: web.Request) -> web.Response:
        try:
            return await handler(request)
        except ProxyError as err:
            return error_response(err, "")

    return answer


async def _reload(request: web.Request) -> web.Response:
    report = await request.app[RELOADER].reload("admin")
    status = 422 if report.result == "failed" else 200
    return web.Response(
        status=status, body=orjson.dumps(report.public()), content_type="application/json"
    )


def _admin_call(name: str) -> AdminHandler:
    async def call(request: web.Request) -> web.Response:
        admin = request.app[STATE].admin  # the serving generation's
        assert admin is not None
        handler: AdminHandler = (
            admin.reset_breaker if name == "reset_breaker" else admin.clear_cache
        )
        return await handler(request)

    return call


def sibling_app(app: web.Application, fleet: Fleet) -> web.Application:
    """What worker `fleet.index` answers on its socket: a metrics snapshot, and the admin calls
    worker 0 passes on."""
    own = web.Application()
    own[STATE] = app[STATE]
    own[RELOADER] = app[RELOADER]

    async def snapshot_now(request: web.Request) -> web.Response:
        try:
            await snapshot(fleet, request.app[STATE].metrics)
        except OSError as exc:  # the run directory is gone: the supervisor is exiting
            return web.json_response({"error": str(exc)}, status=503)
        return web.json_response({"pid": os.getpid()})

    own.router.add_post("/fleet/snapshot", snapshot_now)
    own.router.add_post("/admin/reload", _own(_reload))
    own.router.add_post("/admin/breakers/{route}/reset", _own(_admin_call("reset_breaker")))
    own.router.add_delete("/admin/cache/{route}", _own(_admin_call("clear_cache")))
    return own


FLEET = web.AppKey("fleet", Fleet)


def status_note(fleet: Fleet | None) -> dict[str, Any] | None:
    """What the status page says of the worker it shows."""
    if fleet is None:
        return None
    return {"index": fleet.index, "workers": fleet.workers}


__all__ = ["FLEET", "combine_admin", "combine_reloads", "exposition", "fan_out", "sibling_app"]

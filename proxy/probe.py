"""The active probe a route's breaker sends while open (`breaker.probe`): the operator's request,
through the route's own upstream, with the route's outbound headers (its credentials)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from multidict import CIMultiDict

from policies.breaker import ProbeSender
from policies.core.flow import Flow
from proxy.config import RouteConfig
from proxy.forward import Upstream

if TYPE_CHECKING:
    from proxy.pipeline import Deps


def probe_sender(cfg: RouteConfig, deps: Deps) -> ProbeSender | None:
    """What the route's breaker calls to probe the vendor; None when no probe is configured.

    The probe gets one attempt of `timeouts.per_try` and returns the vendor's status; a failed
    exchange raises the same errors a request's attempt would.
    """
    probe = cfg.breaker.probe if cfg.breaker is not None else None
    if probe is None:
        return None
    upstream = Upstream(cfg, deps.session, deps.clock)
    path, _, query = probe.path.partition("?")
    body = probe.body.encode()
    numbers = itertools.count(1)

    async def send() -> int:
        # The built route's headers: credentials from the environment, empty ones left out.
        route = deps.routes.get(cfg.name)
        headers: CIMultiDict[str] = CIMultiDict(route.set_headers if route is not None else ())
        if body:
            headers["Content-Type"] = "application/json"
        now = deps.clock.now()
        flow = Flow(
            route=cfg.name,
            method=probe.method,
            path=path,
            query_string=query,
            headers=headers,
            body=body,
            request_id=f"breaker-probe-{next(numbers)}",
            client="",
            deadline=now + cfg.timeouts.per_try,
            started=now,
        )
        reply = await upstream(flow)
        reply.discard()  # a streamed answer's connection goes back; nobody reads the body
        return reply.status

    return send

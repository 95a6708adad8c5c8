"""The start-up check of aiohttp's private parts that proxy/guard.py and proxy/outbound.py rely
on: it finds them all in the aiohttp the suite runs, names the one a different aiohttp lacks,
and a proxy whose aiohttp lacks one refuses to start (exit 1, naming it) instead of serving
without its limits."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from aiohttp import web, web_protocol, web_runner

from proxy.internals import HANDLER_NAMES, RESPONSE_NAMES, missing_internals
from testkit.procs import ROOT


def test_the_installed_aiohttp_has_every_internal_the_guard_uses() -> None:
    assert missing_internals() == []


def test_a_handler_without_one_of_them_is_named() -> None:
    # A stand-in for a RequestHandler from an aiohttp that renamed `_messages`.
    kept = {name: None for name in HANDLER_NAMES if name != "_messages"}
    handler = type("RequestHandler", (), kept)
    assert missing_internals(handler=handler) == ["RequestHandler._messages"]


def test_a_server_that_no_longer_keeps_its_options_is_named() -> None:
    class Server(web.Server):
        def __init__(self, handler: Any, **kwargs: Any) -> None:
            super().__init__(handler, **kwargs)
            del self._kwargs  # as if a later aiohttp stored them elsewhere

    found = missing_internals(server=Server, runner=web_runner.AppRunner, module=web_protocol)
    assert found == ["Server._kwargs"]


def test_a_response_protocol_without_one_of_them_is_named() -> None:
    # A stand-in for a client ResponseHandler from an aiohttp that renamed its parameters call.
    kept = {name: None for name in RESPONSE_NAMES if name != "set_response_params"}
    response = type("ResponseHandler", (), kept)
    assert missing_internals(response=response) == ["ResponseHandler.set_response_params"]


def test_a_request_or_message_without_what_bodies_reads_is_named() -> None:
    # Stand-ins for a request that keeps its parsed message under another name, and a parsed
    # message that no longer says which compression the parser chose.
    request = type("BaseRequest", (), {"ATTRS": web.BaseRequest.ATTRS - {"_message"}})
    message = type("RawRequestMessage", (), {"method": None})
    found = missing_internals(request=request, message=message)
    assert found == ["BaseRequest._message", "RawRequestMessage.compression"]


@pytest.mark.e2e
def test_the_proxy_refuses_to_start_without_them(tmp_path: Any) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("routes:\n  v:\n    prefix: /v\n    upstream: http://127.0.0.1:9\n")
    # The same proxy, in an interpreter whose RequestHandler lost a method the guard overrides.
    code = (
        "import sys, aiohttp.web_protocol as p; del p.RequestHandler.finish_response; "
        "from proxy.cli import main; "
        f"sys.exit(main(['--config', {str(config)!r}, '--port', '0', '--admin-port', '0']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 1
    assert "RequestHandler.finish_response" in done.stderr
    assert "refusing to serve" in done.stderr
    assert "listening" not in done.stdout

"""The listening sockets: what each one is for, the error that names how to move one whose port
is taken, and the hold a supervisor keeps on a port its workers share (SO_REUSEPORT)."""

from __future__ import annotations

import contextlib
import os
import socket

Listener = tuple[str, str]  # what it is (after its address), how to give it another port
AGENTS: Listener = ("", "--port or server.port (make run PORT=...)")
ADMIN: Listener = (
    " for the admin endpoints",
    "--admin-port or server.admin_port (make run ADMIN_PORT=...; 0 = any free port)",
)


def address(host: str, port: int) -> str:
    """`host:port`, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class CannotListen(Exception):
    """A listening socket could not be opened (address in use, no permission ...); the message
    names the listener and how to give it another port."""

    def __init__(self, host: str, port: int, reason: str, listener: Listener) -> None:
        what, flags = listener
        super().__init__(
            f"cannot listen on {address(host, port)}{what}: {reason}; choose another port "
            f"with {flags}"
        )


def reason(exc: OSError) -> str:
    """Why a bind failed, without asyncio's repetition of the address."""
    return os.strerror(exc.errno) if exc.errno else str(exc)


def hold(host: str, port: int, listener: Listener) -> tuple[list[socket.socket], int]:
    """Bind `host:port` (every address the host names) for this process alone, then let only
    sockets with SO_REUSEPORT of this user join it: the workers, which listen on it, never a
    stranger already there. Port 0 becomes one free port, the same on every address. The
    sockets never listen, so no connection waits on them. Raises CannotListen."""
    held: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        for family, kind, proto, _, sockaddr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            held.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio binds it: v4 has a socket of its own
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((sockaddr[0], port, *sockaddr[2:]))
            port = port or sock.getsockname()[1]
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    except OSError as exc:
        for sock in held:
            sock.close()
        raise CannotListen(host, port, reason(exc), listener) from exc
    return held, port


def release(held: list[socket.socket]) -> None:
    for sock in held:
        with contextlib.suppress(OSError):
            sock.close()

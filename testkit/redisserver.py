"""A real redis-server for tests: started on a free loopback port, killable, restartable."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile

from redis.asyncio import Redis

from testkit.procs import Child, StartError, free_port
from testkit.waiting import wait_until


class RedisServer:
    """One redis-server with persistence off; `stop()` kills it, `start()` brings it back on the
    same port."""

    def __init__(self, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: apt-get install redis-server")
        self.binary = binary
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="search-proxy-redis-")
        self._child: Child | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        """The running process, or None while stopped."""
        return self._child.proc if self._child is not None else None

    def start(self) -> None:
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--dir", self.dir, "--protected-mode", "no"]
        self._child = Child("redis", argv)
        try:
            wait_until(self._pong, within=5, interval=0.01)
        except TimeoutError:
            tail = self._child.output_tail()
            self.stop()
            raise StartError(f"redis-server did not start on port {self.port}: {tail}") from None

    def _pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """Kill it (SIGKILL, as a crash would); `start()` brings it back."""
        if self._child is not None:
            self._child.kill()
            self._child = None

    def flush(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
            s.sendall(b"FLUSHALL\r\n")
            s.recv(16)


async def redis_time(client: Redis) -> float:
    """Redis's own clock (TIME) in seconds: the clock its Lua scripts, and so the shared rate
    limit buckets, run on."""
    seconds, micros = await client.time()
    return seconds + micros / 1_000_000

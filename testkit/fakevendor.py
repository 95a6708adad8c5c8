"""The fake search vendor, shipped in the package as `proxy.testing.fakevendor` (agents' test
suites use it through the pytest plugin); here under its old name for tests/ and bench/, with a
way to run it as a child process."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from proxy.testing import fakevendor as shipped
from proxy.testing.fakevendor import *  # noqa: F403 (the shipped fake vendor, under its old name)
from testkit.procs import Child

__all__ = [*shipped.__all__, "FakeVendorProcess"]


class FakeVendorProcess:
    """``python -m proxy.testing.fakevendor ARGS`` in a child process; ``with`` starts and stops it.

    ``wrapper`` goes in front of the command (e.g. ``taskset -c 1``).
    """

    def __init__(
        self, *args: str, host: str = "127.0.0.1", port: int = 0, wrapper: Sequence[str] = ()
    ) -> None:
        self.args = list(args)
        self.host = host
        self.port = port
        self.wrapper = list(wrapper)
        self.child: Child | None = None

    def start(self, timeout: float = 20.0) -> FakeVendorProcess:
        """Start it and read the port it prints; StartError if it does not come up."""
        argv = [*self.wrapper, sys.executable, "-m", "proxy.testing.fakevendor"]
        argv += ["--host", self.host, "--port", str(self.port), *self.args]
        self.child = Child("fakevendor", argv, pipe_stdout=True)
        self.port = self.child.read_port(timeout)
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; idempotent."""
        if self.child is not None:
            self.child.stop()

    def __enter__(self) -> FakeVendorProcess:
        return self.start() if self.child is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""The proxy as a separate process (`python -m proxy`), for what only a real process shows:
exit codes, signals, and the JSON log lines it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from typing import Any

import yaml

from testkit.procs import Child, StartError
from testkit.waiting import wait_until


class ProxyProcess:
    """Start with a YAML-shaped dict; `.url` (and `.admin_url`, the admin listener) once
    listening; `.lines` holds everything it writes (stdout and stderr, line by line). Both
    listeners take free ports."""

    def __init__(
        self,
        config: dict[str, Any] | None,
        env: dict[str, str] | None = None,
        *,
        config_path: str | None = None,
    ) -> None:
        """`config` is written to a temporary file, or to `config_path` (kept at the end);
        None: `config_path` holds the config already (a ConfigMap-like mount of symlinks)."""
        self._own_file = config_path is None
        if config_path is None:
            fd, config_path = tempfile.mkstemp(suffix=".yaml", prefix="search-proxy-")
            os.close(fd)
        self.config_path = config_path
        if config is not None:
            with open(config_path, "w") as f:
                yaml.safe_dump(config, f)
        self.env = {**os.environ, **(env or {})}
        self.child: Child | None = None
        self.lines: list[str] = []
        self.port: int | None = None
        self.admin_port: int | None = None
        self._listening = threading.Event()
        self._reader: threading.Thread | None = None

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.child.proc if self.child is not None else None

    def start(self, timeout: float = 10.0) -> ProxyProcess:
        argv = [sys.executable, "-m", "proxy", "--config", self.config_path, "--port", "0"]
        argv += ["--admin-port", "0"]
        self.child = Child("proxy", argv, env=self.env, pipe_stdout=True, merge_stderr=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._listening.wait(timeout):
            self.stop()
            raise StartError("proxy did not start:\n" + "\n".join(self.lines))
        return self

    def _read(self) -> None:
        assert self.child is not None and self.child.proc.stdout is not None
        for raw in self.child.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.lines.append(line)
            if '"listening"' in line:
                listening = json.loads(line)
                self.port, self.admin_port = listening["port"], listening["admin_port"]
                self._listening.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def events(self, name: str) -> list[dict[str, Any]]:
        """The parsed JSON log lines whose event is `name`."""
        found = []
        for line in list(self.lines):
            if line.startswith("{"):
                event = json.loads(line)
                if event.get("event") == name:
                    found.append(event)
        return found

    def wait_for_event(self, name: str, timeout: float = 5.0) -> list[dict[str, Any]]:
        """The `name` events, once there is at least one (blocking)."""
        try:
            return wait_until(lambda: self.events(name), timeout, interval=0.01)
        except TimeoutError:
            raise AssertionError(f"no {name!r} event in:\n" + "\n".join(self.lines)) from None

    def stop(self) -> int | None:
        """SIGTERM and wait for the exit (up to 15 s); returns the exit code."""
        if self.child is None:
            return None
        try:
            if self.child.alive():
                self.child.proc.terminate()
            code = self.child.proc.wait(timeout=15)
            if self._reader is not None:
                self._reader.join(5)  # the last lines, written just before exiting
            return code
        finally:
            self.child.stop()
            if self._own_file:
                os.unlink(self.config_path)

    def __enter__(self) -> ProxyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.child is not None:
            self.child.kill()

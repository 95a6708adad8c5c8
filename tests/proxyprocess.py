"""The proxy as a separate process (`python -m proxy`), for what only a real process shows:
exit codes, signals, and the JSON log lines it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent


class ProxyProcess:
    """Start with a YAML-shaped dict; `.url` once listening; `.lines` holds its stdout lines."""

    def __init__(self, config: dict[str, Any], env: dict[str, str] | None = None) -> None:
        fd, self.config_path = tempfile.mkstemp(suffix=".yaml", prefix="search-proxy-")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(config, f)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        self.port: int | None = None
        self._listening = threading.Event()

    def start(self, timeout: float = 10.0) -> ProxyProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "--config", self.config_path, "--port", "0"],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        if not self._listening.wait(timeout):
            self.stop()
            raise RuntimeError("proxy did not start:\n" + "\n".join(self.lines))
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if '"listening"' in line:
                self.port = json.loads(line)["port"]
                self._listening.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.events(name)
            if found:
                return found
            time.sleep(0.01)
        raise AssertionError(f"no {name!r} event in:\n" + "\n".join(self.lines))

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=15)
        finally:
            os.unlink(self.config_path)

    def __enter__(self) -> ProxyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

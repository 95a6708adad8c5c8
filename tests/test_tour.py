"""The README's quick start and five-minute tour, walked as written on a fresh clone: `git clone`
of this repository (what is committed) into a temporary directory, each command run there in a
process of its own (make included), the proxy's documented ports swapped for free ones (PORT=,
ADMIN_PORT=, as the README says). The clone reuses this checkout's venv through a `.venv` of
links, with make's own stamps saying it is installed, so nothing is pip-installed into a shared
venv.

`make test` runs with PYTEST_ARGS=--collect-only: the suite it would run is this one."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.browser import Browser, chromium
from testkit.procs import ROOT, free_port
from testkit.waiting import eventually, wait_until

_MAKE_STATE = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def blocks(text: str) -> list[tuple[str, str]]:
    """The code blocks of `text`, in order, with their language."""
    return re.findall(r"^```(sh|python)\n(.*?)^```", text, re.S | re.M)


def commands(block: str) -> list[str]:
    """The commands of an `sh` block, comments dropped."""
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh clone of this repository, its `.venv` this checkout's, seen through links."""
    root = tmp_path_factory.mktemp("tour") / "search-proxy"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(root)], check=True, timeout=60)
    venv, shared = root / ".venv", (ROOT / ".venv").resolve()
    venv.mkdir()
    for entry in shared.iterdir():
        if not entry.name.startswith("."):  # bin, lib, pyvenv.cfg, mcp2 ...: shared
            (venv / entry.name).symlink_to(entry)
    stamp = subprocess.run(
        "cksum pyproject.toml | cut -d' ' -f1",
        shell=True,
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    for kind in ("run", "test"):  # make's record that this pyproject.toml is installed
        (venv / f".{kind}-{stamp}").touch()
    return root


def environment(clone: Path) -> dict[str, str]:
    """The shell a reader types in: the clone's code first (the shared venv's own install
    points at another checkout), no make state inherited from a `make test` running this."""
    env = {k: v for k, v in os.environ.items() if k not in _MAKE_STATE}
    env["PYTHONPATH"] = str(clone)
    return env


def started(argv: list[str], clone: Path) -> subprocess.Popen[str]:
    """A command in a process group of its own, as a terminal's foreground job."""
    return subprocess.Popen(
        argv,
        cwd=clone,
        env=environment(clone),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def ctrl_c(job: subprocess.Popen[str]) -> str:
    """What Ctrl-C does to a foreground job: SIGINT to its whole process group. Returns what
    it printed; fails if any process of the group outlives it."""
    os.killpg(job.pid, signal.SIGINT)
    out, _ = job.communicate(timeout=30)

    def gone() -> bool:
        try:
            os.killpg(job.pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_until(gone, within=10)  # TimeoutError: a process of the job outlived Ctrl-C
    return out


def until_printed(job: subprocess.Popen[str], marker: str) -> list[str]:
    """The job's lines up to the first containing `marker`."""
    assert job.stdout is not None
    seen = []
    for line in job.stdout:
        seen.append(line)
        if marker in line:
            return seen
    pytest.fail(f"exited before printing {marker!r}:\n{''.join(seen)}")


def quick_start(clone: Path) -> list[str]:
    text = section((clone / "README.md").read_text(encoding="utf-8"), "Quick start")
    return [c for lang, block in blocks(text) if lang == "sh" for c in commands(block)]


def test_the_quick_start_is_make_run_and_make_test_then_make_demo(clone: Path) -> None:
    assert quick_start(clone) == ["make run", "make test", "make demo"]


def test_make_run_serves_until_ctrl_c(clone: Path) -> None:
    port, admin_port = free_port(), free_port()
    job = started(["make", "run", f"PORT={port}", f"ADMIN_PORT={admin_port}"], clone)
    try:
        lines = until_printed(job, '"listening"')
        assert f'"port":{port}' in lines[-1] and f'"admin_port":{admin_port}' in lines[-1]
        status = subprocess.run(
            ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", f"localhost:{port}/healthz"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        assert status.stdout == "200"
    finally:
        out = ctrl_c(job)
    assert '"stopped"' in out


def test_make_test_sets_up_and_collects_the_suite(clone: Path) -> None:
    done = subprocess.run(
        ["make", "test", "PYTEST_ARGS=--collect-only"],
        cwd=clone,
        env=environment(clone),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^\d{4,} tests collected", done.stdout, re.M), done.stdout[-2000:]
    assert "pip install" not in done.stdout  # the stamps held: the shared venv is untouched


@pytest.fixture
def demo(clone: Path) -> Iterator[tuple[int, int, subprocess.Popen[str]]]:
    port, admin_port = free_port(), free_port()
    job = started(["make", "demo", f"PORT={port}", f"ADMIN_PORT={admin_port}"], clone)
    try:
        until_printed(job, "search-proxy demo:")
        yield port, admin_port, job
    finally:
        if job.poll() is None:
            ctrl_c(job)


def test_the_tour_runs_as_written_against_make_demo(
    clone: Path, demo: tuple[int, int, subprocess.Popen[str]]
) -> None:
    port, admin_port, job = demo
    tour = section((clone / "README.md").read_text(encoding="utf-8"), "A five-minute tour")
    outputs = []
    for lang, block in blocks(tour):
        code = block.replace(":8080", f":{port}").replace(":8081", f":{admin_port}")
        argv = ["bash", "-e", "-o", "pipefail", "-c", code]
        if lang == "python":
            argv = [str(clone / ".venv" / "bin" / "python"), "-c", code]
        done = subprocess.run(
            argv, cwd=clone, env=environment(clone), capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"{block}\n{done.stdout}{done.stderr}"
        outputs.append(done.stdout)

    sdk, search, mcp, failover, breakers, status = outputs
    assert sdk == "https://example.com/circuit-breaker/1\n"  # the fake vendor's first result
    assert '"provider":"tavily"' in search and '"results":[{' in search
    assert '"isError":false' in mcp and "Answered by tavily." in mcp
    assert failover.splitlines() == [
        "X-Search-Provider: exa",
        "X-Search-Failover: down failed: upstream 503",
    ]
    assert '"down":{"state":"open"' in breakers
    # One failover answered the first request, and one each of the three after it.
    assert status == "breaker open | failovers answered: 4\n"
    asyncio.run(the_status_page_shows_the_down_route_open(admin_port))

    out = ctrl_c(job)  # "Ctrl-C there stops the proxy and its fake vendors"
    assert "search-proxy demo: stopped" in out
    assert "provider=exa" in out and "breaker=open" in out  # what the first terminal showed
    for listener in (port, admin_port):
        refused = subprocess.run(["curl", "-s", f"localhost:{listener}/healthz"], timeout=10)
        assert refused.returncode == 7  # curl: could not connect


async def the_status_page_shows_the_down_route_open(admin_port: int) -> None:
    """What "open http://localhost:8081/ in a browser" shows, in a headless Chromium: the
    `down` route's card red, its breaker open, its failovers counted."""
    assert chromium() is not None, "chromium is not installed: `make test` installs it"
    card = "document.querySelector('[data-route=down]')"
    async with Browser(f"http://127.0.0.1:{admin_port}/") as page:
        await eventually(lambda: page.evaluate(f"Boolean({card})"), within=10)
        assert await page.evaluate(f"{card}.classList.contains('bad')")
        assert await page.evaluate(f"{card}.querySelector('[data-breaker]').dataset.breaker") == (
            "open"
        )
        text = await page.evaluate(f"{card}.textContent")
        assert "failovers: answered 4" in text and "retry in" in text

"""The supervisor of `server.workers` above 1: the CLI validates the config, then becomes this
(`exec`, so it holds none of the app's memory). It holds the ports, starts each worker as a fresh
`python -m proxy`, restarts a dead one with backoff, passes SIGTERM and SIGHUP on to every worker,
and exits once all are gone: 0 when every serving worker drained and exited 0."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
import structlog

from proxy.fleetmetrics import retire_worker, write_supervisor
from proxy.listeners import ADMIN, AGENTS, CannotListen, hold, release
from proxy.logs import configure_logging

log = structlog.get_logger("search_proxy", supervisor=True)

# A worker that dies sooner than this after its start died "quickly": each quick death in a row
# doubles the wait before the next start, from the first (at once) up to MAX_BACKOFF_S, so a
# crash loop restarts twice a minute, not as fast as it can.
STABLE_S = 30.0
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
START_TIMEOUT_S = 60.0  # a worker not listening by then is killed (and counts as a death)
ENV = "SEARCH_PROXY_WORKER"  # what a worker is told of its place, JSON (Fleet.env)
CONFIG_FILE = "config.yaml"  # the config the fleet started on, never rewritten
APPLIED_FILE = "applied.yaml"  # the last config a reload applied, once one has
_PR_SET_PDEATHSIG = 1


def restart_delay(quick_deaths: int) -> float:
    """Seconds to wait before starting a worker again, after `quick_deaths` quick deaths in a
    row (the first restart is at once: a worker that served a while and died is wanted back)."""
    if quick_deaths <= 1:
        return 0.0
    return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2.0 ** (quick_deaths - 2))


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


@dataclass(frozen=True)
class Fleet:
    """This worker's place: `index` of `workers`, the supervisor's run directory."""

    index: int
    workers: int
    run_dir: Path
    ready_fd: int = -1
    supervisor: int = 0  # its pid

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Fleet | None:
        """The fleet the supervisor started this process in; None: a process of its own."""
        raw = env.get(ENV)
        if not raw:
            return None
        given = orjson.loads(raw)
        return cls(
            index=int(given["index"]),
            workers=int(given["workers"]),
            run_dir=Path(given["run_dir"]),
            ready_fd=int(given["ready_fd"]),
            supervisor=int(given["supervisor"]),
        )

    def env(self) -> str:
        """What `from_env` reads."""
        return orjson.dumps(
            {
                "index": self.index,
                "workers": self.workers,
                "run_dir": str(self.run_dir),
                "ready_fd": self.ready_fd,
                "supervisor": self.supervisor,
            }
        ).decode()

    @property
    def config_file(self) -> Path:
        return self.run_dir / CONFIG_FILE

    @property
    def applied_file(self) -> Path:
        return self.run_dir / APPLIED_FILE

    def socket(self, index: int) -> Path:
        """Worker `index`'s unix socket, for its siblings only (the directory is the user's)."""
        return self.run_dir / f"worker-{index}.sock"

    @property
    def siblings(self) -> list[int]:
        return [i for i in range(self.workers) if i != self.index]

    def follow_supervisor(self) -> None:
        """Drain and exit (SIGTERM) if the supervisor dies, however it dies (Linux)."""
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != self.supervisor:  # it died before the line above took effect
            os.kill(os.getpid(), signal.SIGTERM)

    def ready(self) -> None:
        """Tell the supervisor this worker is listening."""
        if self.ready_fd >= 0:
            with contextlib.suppress(OSError):
                os.write(self.ready_fd, b"\n")
                os.close(self.ready_fd)

    def keep_config(self, data: bytes) -> None:
        """A reload applied `data`: a worker restarted from now on starts on it, with the
        restart-only settings still as the fleet started (proxy/cli.py's `_worker_config`)."""
        tmp = self.applied_file.with_name(f".{APPLIED_FILE}.{os.getpid()}")
        try:
            tmp.write_bytes(data)
            tmp.replace(self.applied_file)
        except OSError as exc:
            log.warning("worker_config_not_kept", error=str(exc))


@dataclass(frozen=True)
class Plan:
    """What the CLI hands the supervisor, once the config validated."""

    config: str  # the config file's path, as given
    host: str
    port: int
    admin_host: str
    admin_port: int
    workers: int
    run_dir: str  # the run directory, created by the CLI with the config it validated in it
    log_level: str = "info"
    log_format: str = "json"
    listening: dict[str, Any] = field(default_factory=dict)  # for the `listening` line

    def argv(self) -> list[str]:
        """How to run the supervisor on this plan."""
        plan = orjson.dumps(self.__dict__).decode()
        return [sys.executable, "-m", "proxy.supervisor", plan]


def _gone(proc: asyncio.subprocess.Process) -> bool:
    """Whether `proc` has exited, asked of the kernel: asyncio sets `returncode` only once its
    watcher has reaped the child and the loop has run the callback, so a worker just killed
    still looks alive to it, and a signal meant for it would go to a dead pid."""
    if proc.returncode is not None:
        return True
    try:  # WNOWAIT: a zombie is left for asyncio's watcher to reap
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


def _send(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    """Signal a worker `_gone` found alive. Not `Process.send_signal`: its Popen polls first,
    and may reap a worker that just died, so asyncio's watcher finds no child and reports
    exit status 255 instead of how the worker ended."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, sig)


@dataclass
class _Worker:
    slot: int
    proc: asyncio.subprocess.Process | None = None
    started: float = 0.0
    serving: bool = False
    quick_deaths: int = 0
    owes_reload: bool = False  # a SIGHUP came while it started: passed on once it serves


class Supervisor:
    """Runs a Plan's workers until SIGTERM or SIGINT."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.run_dir = Path(plan.run_dir)
        self.workers = [_Worker(i) for i in range(plan.workers)]
        self.stopping = asyncio.Event()
        self.restarts = 0
        self.failed: list[str] = []  # serving workers that did not exit 0 when asked to stop

    # -- one worker --------------------------------------------------------------------------

    async def _start(self, worker: _Worker) -> int | None:
        """Start the worker of a slot and wait until it listens; its exit status if it exits
        first (or is killed for taking too long), None once it serves."""
        plan = self.plan
        read_end, write_end = os.pipe()
        fleet = Fleet(worker.slot, plan.workers, self.run_dir, write_end, os.getpid())
        argv = [sys.executable, "-m", "proxy", "--config", plan.config, "--host", plan.host]
        argv += ["--port", str(plan.port), "--admin-port", str(plan.admin_port)]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, ENV: fleet.env()},
                pass_fds=(write_end,),
            )
        finally:
            os.close(write_end)
        worker.proc, worker.started, worker.serving = proc, time.monotonic(), False
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[bytes] = loop.create_future()

        def readable() -> None:
            if not ready.done():
                ready.set_result(os.read(read_end, 1))

        loop.add_reader(read_end, readable)
        try:
            said = await asyncio.wait_for(ready, START_TIMEOUT_S)
        except TimeoutError:
            said = b""
            log.error(
                "worker_start_timeout", worker=worker.slot, pid=proc.pid, after_s=START_TIMEOUT_S
            )
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        finally:
            loop.remove_reader(read_end)
            os.close(read_end)
        if said != b"\n":  # the pipe closed: it exited (or was killed) without listening
            return await proc.wait()
        worker.serving = True
        if worker.owes_reload and not _gone(proc):  # else its restart still owes it
            # It may have read the config before the others applied the new one: a reload of
            # the same file again is answered `unchanged`, a missed one would split the fleet.
            worker.owes_reload = False
            _send(proc, signal.SIGHUP)
        return None

    async def _exited(self, worker: _Worker, code: int) -> None:
        """A worker is gone: keep its counters, and say so."""
        assert worker.proc is not None
        pid, serving, worker.serving = worker.proc.pid, worker.serving, False
        await asyncio.to_thread(retire_worker, self.run_dir, worker.slot, pid)
        self._report()
        if self.stopping.is_set():
            if serving and code != 0:
                self.failed.append(f"worker {worker.slot}: {_exit_text(code)}")
            return
        ran = time.monotonic() - worker.started
        worker.quick_deaths = worker.quick_deaths + 1 if ran < STABLE_S else 1
        delay = restart_delay(worker.quick_deaths)
        log.error(
            "worker_exited",
            worker=worker.slot,
            pid=pid,
            exit=_exit_text(code),
            ran_s=round(ran, 1),
            restart_in_s=delay,
            quick_deaths=worker.quick_deaths,
        )

    async def _keep(self, worker: _Worker) -> None:
        """Keep a serving worker's slot filled until the supervisor stops."""
        while True:
            assert worker.proc is not None
            await self._exited(worker, await worker.proc.wait())
            if self.stopping.is_set():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), restart_delay(worker.quick_deaths))
            if self.stopping.is_set():
                return
            self.restarts += 1
            code = await self._start(worker)
            if code is None:
                log.info("worker_restarted", worker=worker.slot, pid=worker.proc.pid)
                self._report()
            # else: it died before listening; the loop counts that death and waits again

    # -- the fleet ---------------------------------------------------------------------------

    def _report(self) -> None:
        up = sum(w.serving for w in self.workers)
        with contextlib.suppress(OSError):
            write_supervisor(self.run_dir, {"up": up, "restarts": self.restarts})

    def _signal(self, sig: signal.Signals) -> None:
        for worker in self.workers:
            alive = worker.proc is not None and not _gone(worker.proc)
            if sig == signal.SIGHUP and not (worker.serving and alive):
                # Starting, or dead and soon started again: it has no handler yet (SIGHUP would
                # kill it), and may read the config before the others apply the new one. It
                # gets the SIGHUP once it serves (`_start`).
                worker.owes_reload = True
            elif alive:
                assert worker.proc is not None
                _send(worker.proc, sig)

    def _stop(self, sig: signal.Signals) -> None:
        if not self.stopping.is_set():
            log.info("shutting_down", signal=sig.name, workers=self.plan.workers)
        self.stopping.set()
        self._signal(signal.SIGTERM)

    async def run(self) -> int:
        """Serve until asked to stop; the exit status."""
        plan = self.plan
        try:
            agents, port = hold(plan.host, plan.port, AGENTS)
        except CannotListen as exc:
            print(f"search-proxy: {exc}", file=sys.stderr)
            return 1
        try:
            admin, admin_port = hold(plan.admin_host, plan.admin_port, ADMIN)
        except CannotListen as exc:
            release(agents)
            print(f"search-proxy: {exc}", file=sys.stderr)
            return 1
        self.plan = plan = replace(plan, port=port, admin_port=admin_port)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop, sig)
        loop.add_signal_handler(signal.SIGHUP, self._signal, signal.SIGHUP)
        try:
            return await self._serve()
        finally:
            release(agents + admin)

    async def _serve(self) -> int:
        plan = self.plan
        started = await asyncio.gather(*(self._start(w) for w in self.workers))
        failed = [
            (w, code) for w, code in zip(self.workers, started, strict=True) if code is not None
        ]
        if failed or self.stopping.is_set():
            asked = self.stopping.is_set()  # by a signal, while the workers started
            self._stop(signal.SIGTERM)
            codes = [await w.proc.wait() for w in self.workers if w.proc is not None]
            if failed and not asked:
                worker, code = failed[0]
                log.error("worker_did_not_start", worker=worker.slot, exit=_exit_text(code))
                return code if code > 0 else 1  # 2: its config error, 1: its port ...
            return 0 if all(c in (0, -signal.SIGTERM) for c in codes) else 1
        self._report()
        log.info(
            "listening",
            host=plan.host,
            port=plan.port,
            admin_host=plan.admin_host,
            admin_port=plan.admin_port,
            workers=plan.workers,
            pids=[w.proc.pid for w in self.workers if w.proc is not None],
            **plan.listening,
        )
        await asyncio.gather(*(self._keep(w) for w in self.workers))
        log.info("stopped", failed=self.failed)
        return 1 if self.failed else 0


def main(argv: list[str]) -> int:
    """`python -m proxy.supervisor PLAN` (the CLI runs it; not a command of its own)."""
    plan = Plan(**orjson.loads(argv[0]))
    configure_logging(plan.log_level, plan.log_format)
    try:
        return asyncio.run(Supervisor(plan).run())
    finally:
        shutil.rmtree(plan.run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

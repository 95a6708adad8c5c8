"""``python -m proxy.testing.fakevendor [--port 0] [MODES]``: serve the fake vendor until SIGTERM or
SIGINT, after printing its port on the first line of stdout."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

from proxy.testing.fakevendor.app import FakeVendor


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m proxy.testing.fakevendor",
        description="Fake search vendor (prints its port when ready).",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", type=int, default=3)
    p.add_argument("--fail-ratio", type=float, default=0.0)
    p.add_argument("--fail-status", type=int, default=503)
    p.add_argument("--hang-ratio", type=float, default=0.0)
    p.add_argument("--hang-seconds", type=float, default=20.0)
    p.add_argument("--malformed-ratio", type=float, default=0.0)
    p.add_argument("--empty-words-over", type=int, default=None)
    p.add_argument("--down", action="store_true")
    p.add_argument("--rate-limit", type=int, default=None, help="requests per second")
    p.add_argument("--latency", type=float, default=0.0, help="seconds added to each answer")
    p.add_argument("--jitter", type=float, default=0.0)
    p.add_argument(
        "--latency-sigma", type=float, default=0.0, help="lognormal latency: median --latency"
    )
    p.add_argument("--gzip", action="store_true", help="gzip when Accept-Encoding allows")
    p.add_argument("--record", action="store_true", help="keep every request (memory grows)")
    return p.parse_args(argv)


def vendor_from_args(args: argparse.Namespace) -> FakeVendor:
    """Build a configured ``FakeVendor`` from parsed command-line arguments."""
    v = FakeVendor(seed=args.seed, results=args.results, record=args.record)
    v.fail_ratio(args.fail_ratio, status=args.fail_status)
    v.hang_ratio(args.hang_ratio, seconds=args.hang_seconds)
    v.malformed_ratio(args.malformed_ratio)
    v.empty_when_words_over(args.empty_words_over)
    v.rate_limit(args.rate_limit)
    v.latency(args.latency, args.jitter, sigma=args.latency_sigma)
    v.gzip_when_accepted(args.gzip)
    if args.down:
        v.down()
    return v


async def _serve_forever(args: argparse.Namespace) -> None:
    server = await vendor_from_args(args).start(args.host, args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    print(server.port, flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m proxy.testing.fakevendor``."""
    asyncio.run(_serve_forever(_parse_args(argv)))


if __name__ == "__main__":
    main()

"""Benchmarks of search-proxy: `make bench` or `python -m bench [GROUP ...]` from the repo root.

Each scenario group is one module with a `run(env) -> list[Scenario]` function, listed in
`bench.__main__.GROUPS`. A group starts its own processes through `bench.procs` (so they are
pinned to cores the same way and always stopped), and reports each scenario as one line of
figures, each next to its target, through `bench.report`.

This is a benchmark, not a test: it prints whether each target was met and always exits 0
(unless it could not run at all).
"""

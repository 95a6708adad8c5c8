"""A route's `cache:` section, parsed once at start-up and shared by its cache's parts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policies.core.section import Section
from policies.core.settings import (
    ConfigError,
    boolean,
    header_names,
    join,
    methods,
    parse_duration,
    parse_size,
    positive_duration,
    section,
    texts,
    whole_in,
)


@dataclass(frozen=True)
class CacheConfig:
    """A route's `cache:` section."""

    ttl: float = 600.0  # seconds an entry answers without asking the vendor
    stale_ttl: float = 86400.0  # then seconds it may stand in when the vendor fails
    max_entry_bytes: int = 1024 * 1024
    methods: frozenset[str] = frozenset({"GET", "POST"})
    ignore_body_fields: tuple[str, ...] = ()
    shared: bool = False
    max_entries: int = 10_000
    # Per route and per process: the sum over a config's cached routes is what the cache may
    # hold in memory (deploy/k8s sets 16 MiB per route to fit its 256 MiB sidecar).
    max_bytes: int = 32 * 1024 * 1024
    lock_wait: float = 2.0
    # Request headers that make a different answer (a tenant, a plan): always in the key, even
    # when `shared`. Credential headers are in it anyway unless `shared`.
    vary: tuple[str, ...] = ()


def parse(raw: Any, path: str) -> CacheConfig:
    cfg = section(
        raw,
        path,
        CacheConfig,
        {
            "ttl": positive_duration,
            "stale_ttl": parse_duration,
            "max_entry_bytes": parse_size,
            "methods": methods,
            "ignore_body_fields": texts,
            "shared": boolean,
            "max_entries": whole_in(1),
            "max_bytes": parse_size,
            # 0 is meaningful: no cross-replica fetch lock (see FetchLock.ask).
            "lock_wait": parse_duration,
            "vary": header_names,
        },
    )
    given = raw if isinstance(raw, dict) else {}
    if cfg.max_entry_bytes < 1:
        raise ConfigError(join(path, "max_entry_bytes"), "must be at least 1 byte")
    if cfg.max_entry_bytes > cfg.max_bytes:
        if "max_entry_bytes" in given:
            where, why = "max_entry_bytes", f"must not exceed max_bytes ({cfg.max_bytes} bytes)"
        else:
            where = "max_bytes"
            why = f"must be at least max_entry_bytes ({cfg.max_entry_bytes} bytes, the default)"
        raise ConfigError(join(path, where), why)
    return cfg


SECTION = Section("cache", parse)

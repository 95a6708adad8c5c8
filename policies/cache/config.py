"""A route's `cache:` section, parsed once at start-up and shared by its cache's parts."""

from __future__ import annotations

from dataclasses import dataclass


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

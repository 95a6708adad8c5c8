"""The stateful parts of routes (a breaker, a cache store, rate-limit buckets, a latency window),
kept across a config reload: the next build of a route reuses a part made from equal inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Kept:
    """The parts one build of every route made, each with the inputs it was made from (its
    section's config and the route settings it reads). A build handed the previous build's
    Kept (`Kept(previous)`) reuses a part whose inputs compare equal, else makes a new one;
    `reused` says which, route by route. `built()` ends the build: the previous build's parts
    are let go, or every generation would hold the one before it, back to the first config."""

    def __init__(self, previous: Kept | None = None) -> None:
        self._previous = previous._parts if previous is not None else {}
        self._parts: dict[tuple[str, str], tuple[object, Any]] = {}
        self.reused: dict[str, list[str]] = {}

    def take(self, route: str, part: str, inputs: object, make: Callable[[], T]) -> T:
        """Route `route`'s `part`: the previous build's when made from equal `inputs`, else
        `make()`."""
        key = (route, part)
        found = self._previous.get(key)
        if found is not None and found[0] == inputs:
            value: T = found[1]
            self.reused.setdefault(route, []).append(part)
        else:
            value = make()
        self._parts[key] = (inputs, value)
        return value

    def built(self) -> None:
        """Every route is built: drop the previous build's table (what was reused is in this
        build's own). A part holds its generation (a breaker's probe sends through it), so
        keeping the table kept every past generation's routes alive."""
        self._previous = {}

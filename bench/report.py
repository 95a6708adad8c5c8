"""Figures next to their targets: one line per scenario, plus indented detail lines."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Figure:
    """One measured figure, optionally with a target it is compared to."""

    label: str
    text: str  # the measured value, formatted
    target: str | None = None  # e.g. ">= 97%"; None for a figure shown for context only
    met: bool | None = None  # None when there is no target

    def render(self) -> str:
        if self.target is None:
            return f"{self.label} {self.text}"
        return f"{self.label} {self.text} (target {self.target})"


@dataclass
class Scenario:
    """The outcome of one scenario: its figures, detail lines, or the error that stopped it."""

    name: str
    figures: list[Figure] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def targets(self) -> list[Figure]:
        return [f for f in self.figures if f.met is not None]

    @property
    def met(self) -> bool | None:
        """True if every target was met, False if one was not, None if there were none."""
        if self.error is not None:
            return False
        if not self.targets:
            return None
        return all(f.met for f in self.targets)

    def verdict(self) -> str:
        if self.error is not None:
            return "[error]"
        if self.met is None:
            return "[info]"
        if self.met:
            return "[met]"
        missed = ", ".join(f.label for f in self.targets if not f.met)
        return f"[NOT met: {missed}]"

    def line(self) -> str:
        if self.error is not None:
            return f"{self.name}: ERROR {self.error} [error]"
        return f"{self.name}: {' '.join(f.render() for f in self.figures)} {self.verdict()}"

    def print(self) -> None:
        print(self.line(), flush=True)
        for d in self.details:
            print(f"    {d}", flush=True)


def at_least(label: str, value: float, target: float, fmt: str) -> Figure:
    """A figure that meets its target when `value >= target`; fmt formats both."""
    return Figure(label, fmt.format(value), ">= " + fmt.format(target), value >= target)


def every(label: str, done: int, of: int) -> Figure:
    """A figure that meets its target when all `of` are `done` (`done/of`)."""
    return Figure(label, f"{done}/{of}", f"{of}", done == of)


def at_most(label: str, value: float, target: float, fmt: str) -> Figure:
    """A figure that meets its target when `value <= target`; fmt formats both."""
    return Figure(label, fmt.format(value), "<= " + fmt.format(target), value <= target)


def below(label: str, value: float, target: float, fmt: str) -> Figure:
    """A figure that meets its target when `value < target` (strictly)."""
    return Figure(label, fmt.format(value), "< " + fmt.format(target), value < target)


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of unsorted values; nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def median(values: Sequence[float]) -> float:
    """The median (mean of the middle two for an even count); nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def in_turn(items: Sequence[T], round_no: int) -> list[T]:
    """`items` in the order round `round_no` runs them: forwards, then backwards, and so on,
    so that no item always runs just after the same one or at the same point of a round."""
    return list(items) if round_no % 2 == 0 else list(reversed(items))


def per_round(
    values: Sequence[float], against: Sequence[float], combine: Callable[[float, float], float]
) -> list[float]:
    """`combine(value, reference)` within each round (the i-th of each list ran in round i):
    a ratio or a difference taken between runs minutes apart would carry the host's drift
    between them."""
    if len(values) != len(against):
        raise ValueError(f"{len(values)} rounds against {len(against)}")
    return [combine(v, a) for v, a in zip(values, against, strict=True)]


def spread(values: Sequence[float], fmt: str = "{:.0f}") -> str:
    """`median (min-max, n=3)`, to show how noisy repeated runs were."""
    if len(values) <= 1:
        return fmt.format(values[0]) if values else "n/a"
    return (
        f"{fmt.format(median(values))} "
        f"(min {fmt.format(min(values))}, max {fmt.format(max(values))}, n={len(values)})"
    )

"""`/v1/search` modes that ask several providers at once, on the provider engine's `ask`:
`merge` (up to `search_api.merge_providers` in parallel, their results deduplicated by canonical
URL and ranked by reciprocal rank fusion, each listing the providers that found it) and `race`
(two providers at once: the first with results answers, the other is cancelled). `first`, the
default, asks in order (proxy/search_api.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from policies.fusion import fuse
from policies.providers import Answer

MODES = ("first", "merge", "race")
Mode = Literal["first", "merge", "race"]
T = TypeVar("T")  # how the caller reports a provider's part (search_api's Tried)


@dataclass(frozen=True, slots=True)
class Part(Generic[T]):
    """One provider's part in a search: its answer, its results as the answer lists them
    (normalised), and how the caller reports it."""

    answer: Answer
    results: list[dict[str, Any]]
    report: T


# A provider's part when it is asked (by route name), or when it is skipped (None: it may be
# asked).
Ask = Callable[[str], Coroutine[Any, Any, Part[T]]]
Skip = Callable[[str], Part[T] | None]


async def merge(names: Sequence[str], ask: Ask[T], skip: Skip[T], most: int) -> list[Part[T]]:
    """Ask the first `most` providers of `names` that are not skipped, all at once; every
    part, the skipped ones included, in the order of `names`."""
    chosen: list[str] = []
    parts: dict[str, Part[T]] = {}
    for name in names:
        if len(chosen) >= most:
            break
        skipped = skip(name)
        if skipped is not None:
            parts[name] = skipped
        else:
            chosen.append(name)
    async with asyncio.TaskGroup() as group:
        tasks = {name: group.create_task(ask(name)) for name in chosen}
    parts.update((name, task.result()) for name, task in tasks.items())
    return [parts[name] for name in names if name in parts]


def merged_results(parts: Sequence[Part[T]], count: int) -> list[dict[str, Any]]:
    """The providers' results as one list: each page once, ranked by reciprocal rank fusion,
    with `providers` (every provider that found it, in the order asked); cut to `count`."""
    ranked = {p.answer.provider: p.results for p in parts if p.results}
    out = []
    for fused in fuse(ranked, url_of=lambda result: str(result["url"]))[:count]:
        out.append({**fused.item, "providers": list(fused.providers)})
    return out


async def race(
    names: list[str], ask: Ask[T], skip: Skip[T], cancelled: Callable[[str], Part[T]]
) -> tuple[Part[T] | None, list[Part[T]]]:
    """Ask the first two providers of `names` that are not skipped at once (taking them off
    `names`); the first with results wins and the other is cancelled (its call closed, its
    part made by `cancelled`). Returns the winner (None when neither had results) and every
    part, in the order each ended."""
    parts: list[Part[T]] = []
    tasks: dict[asyncio.Task[Part[T]], str] = {}
    while names and len(tasks) < 2:
        name = names.pop(0)
        skipped = skip(name)
        if skipped is not None:
            parts.append(skipped)
        else:
            tasks[asyncio.ensure_future(ask(name))] = name
    winner: Part[T] | None = None
    try:
        while tasks and winner is None:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: list(tasks).index(t)):
                del tasks[task]
                part = task.result()
                parts.append(part)
                if winner is None and part.results:
                    winner = part
    finally:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)  # the loser lets go of its connection before we answer
        parts.extend(cancelled(name) for name in tasks.values())
    return winner, parts

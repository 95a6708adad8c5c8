"""The record replicas share a circuit through: one transition, its wire form and its hash form."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, NamedTuple

# A circuit's states as metrics, logs and the shared record name them.
CLOSED: Final = "closed"
HALF_OPEN: Final = "half_open"
OPEN: Final = "open"

# Consecutive openings past this say nothing more (the open time reached its maximum long ago);
# the cap keeps a garbled shared record from meaning anything absurd.
MAX_LEVEL: Final = 1000


class Snapshot(NamedTuple):
    """A shared transition; across replicas the highest (since_us, origin) wins."""

    state: str  # closed | open; half-open is derived from opened_at by each replica
    since_us: int  # when the transition happened, unix microseconds
    opened_us: int  # when the circuit last opened, unix microseconds
    failures: int  # consecutive failures that opened it
    origin: str  # the replica that made the transition; breaks ties between equal times
    level: int = 0  # consecutive openings, which set the open time; 0 once a request got through

    def newer_than(self, other: Snapshot) -> bool:
        """Last writer wins, by wall time then origin, so every replica picks the same one."""
        return (self.since_us, self.origin) > (other.since_us, other.origin)

    def encode(self) -> str:
        """The pub/sub message: `state|since_us|opened_us|failures|origin|level`."""
        return (
            f"{self.state}|{self.since_us}|{self.opened_us}|{self.failures}|{self.origin}|"
            f"{self.level}"
        )


def parse_snapshot(data: bytes | str) -> Snapshot | None:
    """Decode a pub/sub message; None for anything malformed (never trust the wire).

    A message without the level (five fields: a replica from before open times adapted) has
    level 0.
    """
    if isinstance(data, bytes):
        data = data.decode("ascii", "replace")
    parts = data.split("|")
    if len(parts) not in (5, 6) or parts[0] not in (CLOSED, OPEN):
        return None
    try:
        level = int(parts[5]) if len(parts) == 6 else 0
        snap = Snapshot(parts[0], int(parts[1]), int(parts[2]), int(parts[3]), parts[4], level)
    except ValueError:
        return None
    if not 0 <= snap.level <= MAX_LEVEL:
        return None
    return snap


def snapshot_from_hash(fields: Mapping[bytes | str, bytes | str]) -> Snapshot | None:
    """Decode the state hash (HGETALL); None when it is missing or malformed."""
    keys = [b"state", b"since", b"opened_at", b"failures", b"origin"]
    if b"level" in fields:
        keys.append(b"level")
    try:
        values = [fields[k] for k in keys]
    except KeyError:
        return None
    return parse_snapshot(b"|".join(v if isinstance(v, bytes) else v.encode() for v in values))

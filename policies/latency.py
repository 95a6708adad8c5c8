"""A route's recent latency as a small decaying histogram, read as a percentile (what
`hedge: {after: auto}` waits for before it sends a second attempt).

Durations fall into log-spaced buckets, each 8% wider than the one below, from 1 ms to 2 min:
memory is fixed and a percentile is read to within 8%, never below the true value. A sample's
weight halves every `half_life` seconds, so the window follows the route as its latency changes.
"""

from __future__ import annotations

import math

from policies.core.clock import Clock

GROWTH = 1.08
FLOOR_S = 0.001
CEILING_S = 120.0
_LOG_GROWTH = math.log(GROWTH)
BUCKETS = math.ceil(math.log(CEILING_S / FLOOR_S) / _LOG_GROWTH) + 1
# Weights grow as 2**(age / half_life) instead of old ones shrinking (one add per sample); past
# this exponent every count is scaled back down, long before a float loses precision.
_RESCALE_EXPONENT = 40.0


def bucket_of(seconds: float) -> int:
    """The bucket holding `seconds`; bucket i holds (FLOOR_S * GROWTH**i, FLOOR_S * GROWTH**(i+1)]
    (the first also everything shorter, the last everything longer)."""
    if not seconds > FLOOR_S:  # also NaN
        return 0
    return min(BUCKETS - 1, math.ceil(math.log(seconds / FLOOR_S) / _LOG_GROWTH) - 1)


def bucket_top(index: int) -> float:
    """The largest duration bucket `index` holds."""
    return FLOOR_S * math.exp((index + 1) * _LOG_GROWTH)


class LatencyWindow:
    """Recent durations of one route's attempts, and their percentiles.

    Two kinds of sample: `record` for an attempt that finished, `record_cut` for one cut short
    (cancelled once another attempt won, or timed out) that took at least that long. A cut
    sample counts as that slow, which keeps a percentile honest when the slow tail is the part
    that gets cancelled. When cut samples outnumber the percentile's tail (more than 5% for the
    95th), the percentile of the whole is out of reach (some attempts never finish) and the
    percentile of the finished attempts is read instead: the latency of attempts that answer.
    """

    __slots__ = ("_clock", "_cut", "_cut_total", "_done", "_done_total", "_half_life", "_since")

    def __init__(self, clock: Clock, half_life: float = 30.0) -> None:
        if not (half_life > 0 and math.isfinite(half_life)):
            raise ValueError(f"half_life must be a positive number of seconds, got {half_life!r}")
        self._clock = clock
        self._half_life = half_life
        self._done = [0.0] * BUCKETS
        self._cut = [0.0] * BUCKETS
        self._done_total = 0.0
        self._cut_total = 0.0
        self._since = clock.now()  # when a new sample weighed 1

    def record(self, seconds: float) -> None:
        """An attempt that finished after `seconds`."""
        weight = self._weight()
        self._done[bucket_of(seconds)] += weight
        self._done_total += weight

    def record_cut(self, seconds: float) -> None:
        """An attempt stopped after `seconds` without finishing: it would have taken longer."""
        weight = self._weight()
        self._cut[bucket_of(seconds)] += weight
        self._cut_total += weight

    def samples(self) -> float:
        """The number of samples the window holds, old ones counted at their decayed weight."""
        return (self._done_total + self._cut_total) / self._weight()

    def percentile(self, p: float, min_samples: float = 20.0) -> float | None:
        """The duration `p` (0.5 = median, 0.95 ...) of attempts take at most, or None while
        fewer than `min_samples` samples say so."""
        weight = self._weight()
        total = self._done_total + self._cut_total
        with_cut = self._cut_total < (1.0 - p) * total
        if not with_cut:
            total = self._done_total
        if total <= 0 or total / weight < min_samples:
            return None
        tail = (1.0 - p) * total * (1.0 + 1e-9)
        above = 0.0
        for i in range(BUCKETS - 1, -1, -1):
            above += self._done[i] + self._cut[i] if with_cut else self._done[i]
            if above > tail:
                return bucket_top(i)
        return bucket_top(0)

    def _weight(self) -> float:
        """The weight of a sample taken now (older samples weigh less, relatively)."""
        exponent = (self._clock.now() - self._since) / self._half_life
        if exponent > _RESCALE_EXPONENT:
            scale = math.exp2(-exponent)
            self._done = [c * scale for c in self._done]
            self._cut = [c * scale for c in self._cut]
            self._done_total *= scale
            self._cut_total *= scale
            self._since = self._clock.now()
            exponent = 0.0
        return math.exp2(max(0.0, exponent))
